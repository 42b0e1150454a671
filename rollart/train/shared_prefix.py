"""Shared-prefix forward: a group's common prompt runs through the model once, not G times.

GRPO samples G answers per prompt, so every member of a group starts with the same tokens (the
system prompt, the task, the assistant header). A plain forward over the right-padded batch
computes those P prefix positions G times, forward and backward. Here the prefix runs once per
group with its key/value cache kept in the autograd graph; the cache is repeated for the G
members and their suffixes attend to it. Gradients from every member flow back through the
one prefix pass, so loss and gradient are those of the plain forward (up to float summation
order; tests/unit/test_shared_prefix.py checks both against it). The prefix length is the
shortest group prefix of the micro-batch (tasks whose prompts share a system prompt share at
least that), so the prefix takes one call with no padding inside the cache.

The suffixes are right-padded to the longest answer; sampled answers differ in length (on the
arithmetic task from ~20 to the 64-token cap), so the suffix rows, sorted by length, go in up
to `MAX_BUCKETS` calls, each trimmed to its own longest row, where that saves positions
(`suffix_buckets`).

For SmolLM2-135M on the arithmetic task (45 prompt tokens, ~48 answer tokens, G = 4) that is
~36 % fewer token-positions through every layer of the update.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def common_prefix_len(ids: Tensor, limit: int) -> int:
    """Length of the prefix all rows of `ids` [g, T] share, at most `limit`."""
    if limit <= 0:
        return 0
    same = (ids[:, :limit] == ids[:1, :limit]).all(0)  # [limit]
    return int(limit if bool(same.all()) else int((~same).nonzero()[0]))


def groups_of(group_ids: list[str]) -> list[list[int]]:
    """Row indices per group, groups in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        out.setdefault(g, []).append(i)
    return list(out.values())


def shared_prefix_hidden(base: nn.Module, input_ids: Tensor, loss_mask: Tensor,
                         group_ids: list[str], min_prefix: int = 8) -> Tensor:
    """Last hidden states [B, T, H] of `base` (a decoder without its LM head) on right-padded
    `input_ids` [B, T], each group's common prefix computed once.

    Two calls, whatever the number of groups: the first L tokens of one member per group
    ([n_groups, L]; L = the shortest group prefix, so no padding is needed), then every row's
    remaining tokens ([B, T-L]) attending to its group's cached keys/values. A group prefix
    stops before the first position any member is trained on (`loss_mask` [B, T-1] is 1 where
    position j predicts a model token j+1). With L < `min_prefix` the plain forward runs."""
    b, t = input_ids.shape
    groups = groups_of(group_ids)
    trained = loss_mask > 0  # [B, T-1]
    prefix = t
    for rows in groups:
        hit = trained[rows].any(0)
        first = int(hit.float().argmax()) if bool(hit.any()) else t - 1
        prefix = min(prefix, common_prefix_len(input_ids[rows], first))
    if prefix < min_prefix:
        return base(input_ids=input_ids).last_hidden_state
    # A row's states are needed up to the target of its last trained position.
    last = torch.where(trained, torch.arange(t - 1, device=trained.device), -1).amax(1)  # [B]
    need = [max(int(j) + 2, prefix + 1) for j in last]
    return _prefix_then_suffix(base, input_ids, groups, prefix, need)


# A call costs ~this many token-positions of work beyond its rows (per-layer launch overhead,
# small GEMMs): a bucket is split off only where it saves more.
CALL_COST_POSITIONS = 64
MAX_BUCKETS = 3


def suffix_buckets(need: list[int], p: int) -> list[list[int]]:
    """Rows (indices into `need`) split into at most MAX_BUCKETS runs of the length order,
    minimising sum(rows x (longest - p)) + CALL_COST_POSITIONS per call (exact, by DP)."""
    order = sorted(range(len(need)), key=lambda i: need[i])
    n = len(order)
    inf = float("inf")
    # best[k][i]: least cost of the first i rows (sorted) in k buckets; cut[k][i]: its last cut
    best = [[inf] * (n + 1) for _ in range(MAX_BUCKETS + 1)]
    cut = [[0] * (n + 1) for _ in range(MAX_BUCKETS + 1)]
    best[0][0] = 0.0
    for k in range(1, MAX_BUCKETS + 1):
        for i in range(1, n + 1):
            for j in range(i):  # bucket = sorted rows j .. i-1; its longest is row i-1
                c = best[k - 1][j] + (i - j) * (need[order[i - 1]] - p) + CALL_COST_POSITIONS
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    k = min(range(1, MAX_BUCKETS + 1), key=lambda k: best[k][n])
    out, i = [], n
    while k > 0:
        j = cut[k][i]
        out.append(order[j:i])
        i, k = j, k - 1
    return out[::-1]


def _prefix_then_suffix(base: nn.Module, ids: Tensor, groups: list[list[int]], p: int,
                        need: list[int]) -> Tensor:
    """[B, T, H]: ids[head of each group, :p] once (its K/V kept with grad), then each bucket
    of rows' ids[:, p:longest] on its groups' K/V. States past a row's `need` are zeros (no
    trained position reads them)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    b, t = ids.shape
    owner = torch.empty(b, dtype=torch.long, device=ids.device)  # [B] group of each row
    for g, rows in enumerate(groups):
        owner[rows] = g
    heads = [rows[0] for rows in groups]
    pre = base(input_ids=ids[heads, :p], past_key_values=DynamicCache(), use_cache=True)
    layers = pre.past_key_values.layers
    kv = [(layer.keys, layer.values) for layer in layers]  # [G, heads, p, d] per layer
    # Buckets rebuild plain caches; other layer kinds (sliding windows) keep their own cache.
    plain = all(type(layer) is DynamicLayer for layer in layers)
    parts: list[Tensor] = []  # [n_rows, longest - p, H] per bucket
    index: list[Tensor] = []
    for rows in suffix_buckets(need, p) if plain else [list(range(b))]:
        end = max(need[i] for i in rows)
        if plain:  # the rows' own copy of their groups' K/V (a gather: differentiable)
            cache = DynamicCache(ddp_cache_data=[(k[owner[rows]], v[owner[rows]]) for k, v in kv])
        else:
            cache = pre.past_key_values
            cache.batch_select_indices(owner)  # [G, ...] -> [B, ...]
        positions = torch.arange(p, end, device=ids.device).unsqueeze(0).expand(len(rows), -1)
        out = base(input_ids=ids[rows, p:end], past_key_values=cache, use_cache=True,
                   position_ids=positions,  # [n, end-p]
                   cache_position=torch.arange(p, end, device=ids.device))
        parts.append(torch.nn.functional.pad(out.last_hidden_state, (0, 0, 0, t - end)))
        index.append(torch.tensor(rows, device=ids.device))
    suffix = torch.cat(parts)[torch.argsort(torch.cat(index))]  # [B, T-p, H] in row order
    return torch.cat([pre.last_hidden_state[owner], suffix], 1)
