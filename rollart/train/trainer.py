"""Policy update: collate trajectories, recompute log-probs, PPO-style epochs, weight export.

The trainer owns the model, the optimizer and (when KL is on) a frozen reference copy. It is
held for the whole run by the trainer service on its compute-class worker; nothing here pickles a
model through task arguments. With several ranks (`rollart/train/distributed.py`) each rank
holds a shard of each, and runs this same update on its share of the batch's rows.
"""

from __future__ import annotations

import copy
import json
import time

import safetensors.torch
import torch
from torch import Tensor

from rollart.action_grammar import TokenTexts
from rollart.algo import (
    compute_policy_loss,
    entropy_from_logits,
    kl_k3,
    masked_mean,
    select_loss_params,
    token_logprobs,
)
from rollart.algo.offpolicy import behaviour_weights, staleness_metrics
from rollart.config import AlgoConfig, TrainConfig
from rollart.storage.blob import Blob, as_bytes
from rollart.storage.weights import tie_key
from rollart.train.batch import Batch, TokenLogits, collate
from rollart.train.distributed import (
    SINGLE,
    Ranks,
    all_reduce_sum,
    device_for,
    full,
    plan_rows,
)
from rollart.train.distributed import shard as shard_model
from rollart.train.safetensors_pack import pack
from rollart.train.state_io import load_optimizer, load_rng, optimizer_files, rng_files
from rollart.types import Trajectory

__all__ = ["Batch", "Trainer", "collate"]


# Metrics that are sums over rows (a row left out adds exactly 0): weighted over the whole
# batch, where the others (ratios, clip fractions) are means over the rows trained.
_LOSS_METRICS = frozenset({"train/loss", "train/pg_loss"})


def micro_weight(loss_mask: Tensor, n_tok: float, n_seq: float, loss_agg: str) -> float:
    """A micro-batch's share of the whole batch's loss (`loss_mask` [b, T-1] its rows): its
    model tokens over the batch's for a token mean, else its sequences (with a model token)
    over the batch's. Over every micro-batch of every rank the shares sum to 1."""
    if loss_agg == "token_mean":
        return float(loss_mask.sum()) / max(n_tok, 1.0)
    return float((loss_mask.sum(1) > 0).sum()) / max(n_seq, 1.0)


class Trainer:
    def __init__(self, model: torch.nn.Module, algo: AlgoConfig, train: TrainConfig,
                 temperature: float = 1.0, pad_id: int = 0, ranks: Ranks = SINGLE,
                 mixed_precision: bool = False, token_texts: TokenTexts | None = None) -> None:
        """`token_texts`: the tokenizer's token texts (rollart.action_grammar.token_texts), so
        batches sampled under a token grammar get the engine's per-position restriction."""
        # A sharded trainer on a CUDA machine trains on its rank's GPU (nccl); otherwise the CPU.
        self.device = device_for(ranks)
        # A model on the meta device (a sharded trainer's skeleton, policy_skeleton) gets memory
        # for its shards only, below; its weights are read in afterwards (load_pretrained).
        skeleton = any(p.is_meta for p in model.parameters())
        if skeleton and not ranks.sharded:
            raise ValueError("a model without weights (meta device) needs a sharded trainer")
        self.model = (model if skeleton else model.to(self.device)).train()
        self.algo, self.cfg, self.ranks = algo, train, ranks
        # The loss's own hyper-parameters, from the algo config fields named like them.
        self.loss_params = select_loss_params(algo.loss, algo.model_dump())
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_id = pad_id
        self.token_texts = token_texts
        self.ref_model = None
        if algo.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        # Sharded: the plain forward. The shared-prefix forward calls the model a number of
        # times that depends on the rows, and every call of a sharded layer is a collective
        # that each rank must make alike.
        prefix = train.shared_prefix and not ranks.sharded
        self.policy = TokenLogits(model, prefix)
        self.ref_policy = (TokenLogits(self.ref_model, prefix)
                           if self.ref_model is not None else None)
        if ranks.sharded:  # every parameter becomes this rank's shard (a DTensor)
            shard_model(self.policy, model, ranks.world, mixed_precision)
            if self.ref_policy is not None:
                shard_model(self.ref_policy, self.ref_model, ranks.world, mixed_precision)
            if skeleton:
                for policy in (self.policy, self.ref_policy):
                    if policy is not None:
                        policy.to_empty(device=self.device)
        # fused: one kernel over all parameters instead of a loop over tensors (several
        # times faster on CPU; not measured by a committed benchmark); same update rule.
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=train.lr, weight_decay=train.weight_decay, fused=True
        )
        self.version = 0  # policy version: number of updates applied
        self.step = 0  # training iterations completed (== version unless updates were skipped)

    # ---- forward helpers ---------------------------------------------------------------
    def _policy(self, model: torch.nn.Module) -> torch.nn.Module:
        if model is self.model:
            return self.policy
        if model is self.ref_model and self.ref_policy is not None:
            return self.ref_policy
        return model if isinstance(model, TokenLogits) else TokenLogits(model,
                                                                        self.policy.shared_prefix)

    def _token_logprobs(self, model: torch.nn.Module, batch: Batch,
                        entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """(log-probs [B, T-1], entropy [B, T-1] or None) of the targets, 0 off the model
        tokens (every consumer masks with `loss_mask`)."""
        sel = batch.loss_mask > 0
        logits = self._policy(model)(batch)  # [N, V]
        lp = token_logprobs(logits[None], batch.targets[sel][None], self.temperature)[0]  # [N]
        zeros = lp.new_zeros(sel.shape)
        ent = zeros.masked_scatter(sel, entropy_from_logits(logits)) if entropy else None
        return zeros.masked_scatter(sel, lp), ent

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        return self._token_logprobs(model, batch)[0]

    # ---- update ------------------------------------------------------------------------
    def update(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One policy update on scored trajectories (advantage set). Returns `train/*` metrics.

        Decoupled PPO: the ratio is taken against the policy at the start of the update (the
        proximal policy). Its log-probs come from the first epoch's own forward passes: the
        optimizer steps once per epoch, after every micro-batch, so each first-epoch forward
        runs at the start parameters (no extra forward pass).

        Every rank gets the whole batch and runs its share of the rows; the normalisers
        (token and sequence counts) are the whole batch's, so the gradients summed over the
        ranks are the one-rank gradient, and every metric is taken over the whole batch."""
        t0 = time.perf_counter()
        trajs = [x for x in trajs if x.num_model_tokens > 0]
        if not trajs:
            return {"train/skipped": 1.0}
        if self._no_signal(trajs):  # before collating: nothing of the batch is needed
            return self._momentum_step(trajs, t0)
        # The normalisers are the whole batch's, rows left out below included. Counted on
        # collate's shifted mask (position 0 is never a target).
        n_seq = float(sum(1 for x in trajs if any(x.loss_mask[1:])))
        n_tok = float(sum(sum(x.loss_mask[1:]) for x in trajs))
        rows = self._signal_rows(trajs)
        # Under "vocab" the loss ignores the sampling restriction: no per-position table.
        vocab = self._vocab_size() if self.algo.constrained_logprobs == "restricted" else None
        batch = collate(rows, self.pad_id, vocab, self.token_texts)
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        algo = self.algo
        plan = self._micro_plan(batch)  # this rank's micro-batches: (rows, Batch, weight on)
        ref_parts = None
        if self.ref_model is not None:
            ref_parts = [self._logprobs(self.ref_model, mb) for _, mb, _ in plan]
        # Parameters at update start, for the trust-region guard (one copy of the weights).
        start = ([p.detach().clone() for p in self.policy.parameters()]
                 if self.cfg.max_kl > 0 else None)
        sums: dict[str, Tensor] = {}
        # Metrics other than the loss are means over the rows trained.
        m_seq = float((batch.loss_mask.sum(1) > 0).sum())
        m_tok = float(batch.loss_mask.sum())
        prox_parts: list[Tensor] = []  # [b_i, T-1] per micro-batch, from the first epoch
        skipped = 0  # epochs whose loss or gradient was nan/inf: never applied
        for epoch in range(self.cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, (_, mb, real) in enumerate(plan):
                logp, ent = self._token_logprobs(self.model, mb, entropy=algo.entropy_coef > 0)
                if epoch == 0:
                    prox_parts.append(logp.detach())
                prox = prox_parts[i]
                # Per micro-batch: the weights are row-local (per token or per sequence).
                is_w, _ = behaviour_weights(prox, mb.behaviour_logprobs, mb.loss_mask,
                                            algo.off_policy, algo.is_cap, algo.icepop_low,
                                            algo.icepop_high)
                loss, m = compute_policy_loss(
                    logp, prox, mb.advantages, mb.loss_mask,
                    loss=algo.loss, loss_agg=algo.loss_agg, loss_params=self.loss_params,
                    ref_logprobs=ref_parts[i] if ref_parts is not None else None,
                    kl_coef=algo.kl_coef, entropy=ent, entropy_coef=algo.entropy_coef,
                    is_weights=is_w,
                )
                # Weight micro-batches so the sum (over micro-batches and ranks) equals the
                # full-batch aggregate; a rank's padding micro-batch weighs 0.
                w = micro_weight(mb.loss_mask, n_tok, n_seq, algo.loss_agg) if real else 0.0
                w_rows = (micro_weight(mb.loss_mask, m_tok, m_seq, algo.loss_agg)
                          if real else 0.0)
                # x world: FSDP averages the ranks' gradients, the loss wants their sum.
                (loss * (w * self.ranks.world)).backward()
                for k, v in m.items():
                    # The loss of a left-out row is exactly 0: the batch's loss sums as is.
                    share = w if k in _LOSS_METRICS else w_rows
                    sums[k] = sums.get(k, torch.zeros((), dtype=torch.float64)) + (
                        v * share / self.cfg.epochs)
            grad_norm = full(torch.nn.utils.clip_grad_norm_(self.policy.parameters(),
                                                            self.cfg.grad_clip))
            if not torch.isfinite(grad_norm):  # a nan/inf loss gives a nan norm too
                skipped += 1
                continue
            self.optimizer.step()
        prox_all = self._whole(batch, plan, prox_parts)  # [B, T-1]
        metrics: dict[str, float] = {
            # |trainer - engine| log-prob gap: ~0 on-policy with synced weights, grows with
            # staleness.
            "train/logprob_mismatch": masked_mean(
                (prox_all - batch.behaviour_logprobs).abs(), batch.loss_mask
            ).item(),
            **staleness_metrics([x.token_versions for x in trajs], self.version),
        }
        metrics.update(behaviour_weights(prox_all, batch.behaviour_logprobs, batch.loss_mask,
                                         algo.off_policy, algo.is_cap, algo.icepop_low,
                                         algo.icepop_high)[1])
        if sums:  # each rank's share of the weighted sums -> the whole batch's
            keys = sorted(sums)
            total = all_reduce_sum(torch.stack([sums[k] for k in keys]), self.ranks)
            metrics.update({k: float(v) for k, v in zip(keys, total.tolist(), strict=True)})
        if start is not None:
            metrics.update(self._kl_guard(batch, plan, prox_all, start))
        metrics["train/grad_norm"] = float(grad_norm)
        metrics["train/nonfinite_skipped"] = float(skipped)
        metrics["train/sequences"] = n_seq
        metrics["train/tokens"] = n_tok
        metrics["train/rows_left_out"] = float(len(trajs) - len(rows))
        metrics["train/update_s"] = dt = time.perf_counter() - t0
        # every real (non-pad) token goes through the forward passes, model tokens or not
        metrics["perf/update_tokens_per_s"] = float(batch.attention_mask.sum()) / max(dt, 1e-9)
        self.version += 1
        self.step += 1
        return metrics

    def _surrogate_only(self) -> bool:
        """The loss is the clipped surrogate alone (no KL, no entropy bonus, no trust-region
        guard): a row whose advantage is 0 then has a loss and a gradient of exactly 0, so
        its forward and backward passes can be left out (a group whose episodes all scored
        alike has zero advantages)."""
        algo = self.algo
        return (algo.loss == "ppo_clip" and algo.kl_coef == 0 and algo.entropy_coef == 0
                and self.ref_model is None and self.cfg.max_kl == 0)

    def _no_signal(self, trajs: list[Trajectory]) -> bool:
        """No row carries signal: the whole batch's passes can be left out. Not sharded: a
        sharded batch without signal runs its passes (a gradient of 0) and steps as usual."""
        return (self._surrogate_only() and not self.ranks.sharded
                and not any(x.advantage for x in trajs))

    def _signal_rows(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """The rows the passes must run: those with a non-zero advantage when a zero one
        contributes nothing (`_surrogate_only`), else all (all, too, when none has signal).
        The caller keeps the whole batch's normalisers, so the gradient is the one of the
        whole batch. Every rank has the whole batch and picks the same rows, so sharded
        ranks still share them alike (`_micro_plan`)."""
        if not self._surrogate_only():
            return trajs
        return [x for x in trajs if x.advantage] or trajs

    def _momentum_step(self, trajs: list[Trajectory], t0: float) -> dict[str, float]:
        """The update of a batch without signal: its gradient is exactly 0, but AdamW still
        moves the weights along its running moments, so each epoch steps with zero gradients,
        exactly as the passes would have ended (same weights, same optimizer state)."""
        for _ in range(self.cfg.epochs):
            for p in self.policy.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {**staleness_metrics([x.token_versions for x in trajs], self.version),
                   "train/loss": 0.0, "train/pg_loss": 0.0, "train/grad_norm": 0.0,
                   "train/no_signal": 1.0, "train/nonfinite_skipped": 0.0,
                   "train/sequences": float(len(trajs)),
                   "train/tokens": float(sum(x.num_model_tokens for x in trajs))}
        metrics["train/update_s"] = time.perf_counter() - t0
        self.version += 1
        self.step += 1
        return metrics

    def _micro_plan(self, batch: Batch) -> list[tuple[Tensor, Batch, bool]]:
        """This rank's micro-batches as (row indices into `batch`, the rows, real?). Ranks
        share the rows by tokens (`plan_rows`); a padding micro-batch (a rank short of rows)
        runs one row again, weighed 0 and left out of every result."""
        size, world = self.cfg.micro_batch_size, self.ranks.world
        lengths = batch.attention_mask.sum(1).tolist() if world > 1 else [0] * len(batch)
        plan = []
        for j, rows in enumerate(plan_rows(lengths, world, self.ranks.rank, size)):
            if world == 1:  # contiguous slices, as ever
                plan.append((torch.arange(j * size, min((j + 1) * size, len(batch))),
                             batch.select(slice(j * size, (j + 1) * size)), True))
                continue
            idx = torch.tensor(rows or [0], dtype=torch.long)
            plan.append((idx, batch.select(idx), bool(rows)))
        return plan

    def _whole(self, batch: Batch, plan: list[tuple[Tensor, Batch, bool]],
               parts: list[Tensor]) -> Tensor:
        """Per-micro-batch rows [b_i, T-1] of every rank -> the whole batch's [B, T-1]."""
        if self.ranks.world == 1:
            return torch.cat(parts)
        out = parts[0].new_zeros(batch.loss_mask.shape)
        for (idx, _, real), part in zip(plan, parts, strict=True):
            if real:
                out[idx.to(out.device)] = part
        return all_reduce_sum(out, self.ranks)

    def _batch_kl(self, batch: Batch, plan: list[tuple[Tensor, Batch, bool]],
                  prox: Tensor) -> float:
        """Mean per-token k3 estimate of KL(prox || current) on the batch's model tokens."""
        new = self._whole(batch, plan, [self._logprobs(self.model, mb) for _, mb, _ in plan])
        return masked_mean(kl_k3(prox, new), batch.loss_mask).item()  # [B, T-1] -> scalar

    @torch.no_grad()
    def _kl_guard(self, batch: Batch, plan: list[tuple[Tensor, Batch, bool]], prox: Tensor,
                  start: list[Tensor]) -> dict[str, float]:
        """Scale the update back towards `start` until the batch KL is <= max_kl.

        theta = start + s * (theta_updated - start). KL grows ~s^2 for small steps, so each try
        multiplies s by 0.9 * sqrt(max_kl / KL); at most 6 tries. The optimizer's moments keep
        the full step (they are running averages of gradients, not of steps). Every rank sees
        the whole batch's KL, so all take the same tries, each on its own shards."""
        max_kl = self.cfg.max_kl
        kl = first = self._batch_kl(batch, plan, prox)
        scale, step = 1.0, None
        params = list(self.policy.parameters())
        for _ in range(6):
            if kl <= max_kl:
                break
            if step is None:  # the update's direction, once
                step = [p.detach() - p0 for p, p0 in zip(params, start, strict=True)]
            scale *= 0.9 * (max_kl / kl) ** 0.5
            for p, p0, d in zip(params, start, step, strict=True):
                p.copy_(p0 + scale * d)
            kl = self._batch_kl(batch, plan, prox)
        return {"train/kl_update": first, "train/kl_final": kl, "train/kl_guard_scale": scale}

    def _vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # ---- weights and checkpoints -------------------------------------------------------
    def export_weights(self) -> dict[str, Tensor]:
        """The full weights (a collective when sharded: every rank calls it, rank 0 keeps the
        result; the others get an empty dict)."""
        out = {}
        for k, v in self.model.state_dict().items():
            whole = full(v).detach()
            if self.ranks.rank == 0:
                out[k] = whole.clone() if whole is v else whole.cpu()
        return out

    def meta_files(self) -> dict[str, bytes]:
        """Step, version, world size and this process's RNG state."""
        meta = {"version": self.version, "step": self.step}
        if self.ranks.sharded:
            meta["world_size"] = self.ranks.world
        return {**rng_files(), "trainer_state.json": json.dumps(meta).encode()}

    def checkpoint_files(self) -> dict[str, Blob]:
        """Weights and state in formats that load without running code (no pickle). One rank
        only: a sharded trainer writes its shards with `rollart/train/sharded_state.py`. The
        tensor files are `ChunkedBytes` (one copy of each tensor: safetensors_pack.py)."""
        if self.ranks.sharded:
            raise RuntimeError("a sharded trainer's checkpoint is written by every rank "
                               "(rollart/train/sharded_state.py)")
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        files: dict[str, Blob] = {
            "model.safetensors": pack(_untie(state)),
            **optimizer_files(self.optimizer),
            **self.meta_files(),
        }
        if self.ref_model is not None:
            ref_state = {k: v.contiguous() for k, v in self.ref_model.state_dict().items()}
            files["reference.safetensors"] = pack(_untie(ref_state))
        return files

    def load_checkpoint_files(self, files: dict[str, Blob]) -> None:
        """Inverse of checkpoint_files, or of a sharded trainer's files at any world size.
        Raises UnsafeCheckpointError for a file that could only be loaded by unpickling it
        (older checkpoints' rng.pt) or that is malformed."""
        from rollart.train.sharded_state import is_sharded_checkpoint, load_shards

        if is_sharded_checkpoint(files.keys()):
            load_shards(self, files)
        elif self.ranks.sharded:
            raise ValueError("this checkpoint was saved by one trainer rank (model.safetensors); "
                             "resume it with train.world_size=1, then save again to grow")
        else:
            self.model.load_state_dict(
                safetensors.torch.load(as_bytes(files["model.safetensors"])), strict=False)
            load_optimizer(self.optimizer, files)
            if self.ref_model is not None and "reference.safetensors" in files:
                ref = safetensors.torch.load(as_bytes(files["reference.safetensors"]))
                self.ref_model.load_state_dict(ref, strict=False)
        load_rng(files)
        meta = json.loads(as_bytes(files["trainer_state.json"]))
        self.version, self.step = int(meta["version"]), int(meta["step"])


def _untie(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each tied tensor once (tied embeddings: the first name; safetensors' own loader refuses
    shared storage). `pack` copies every tensor it is given, so nothing is cloned here."""
    seen: dict[tuple[int, int, torch.dtype], str] = {}
    out = {}
    for k, v in state.items():
        ptr = tie_key(v)  # not the storage: adopted parameters share one (shared_weights)
        if ptr in seen:
            continue  # tied weight: reloaded through the tie with strict=False
        seen[ptr] = k
        out[k] = v
    return out
