"""HFEngine: batched sampling over any HF causal LM with a hand-written KV-cache loop.

Per call, requests are sorted by prompt length and cut into chunks of at most `max_batch_size`;
each chunk runs one batched loop:

    prefill:  left-pad prompts to [B, T], attention_mask [B, T] (1 = real token),
              position_ids = clip(cumsum(mask) - 1, 0)   (every prompt starts at position 0)
    decode:   one token per step for the still-unfinished rows only (finished rows are dropped
              from the DynamicCache with `batch_select_indices`), mask grows by one column.

Sampling parameters are applied per row, so requests with different params share a batch:
temperature 0 means greedy (argmax), top_p is nucleus sampling (the smallest prefix of the sorted
distribution whose mass reaches top_p), and `max_new_tokens` / `stop` are checked per row.

Behaviour log-prob (the trainer must recompute exactly this quantity):

    logprob(token) = log_softmax(float32(logits) / T)[token],  T = temperature if > 0 else 1,

over the full vocabulary, *before* top-p truncation. A request with `allowed_token_ids`
(constrained sampling) has every other logit set to -inf first, so its log-probs are under the
restricted distribution; the trainer applies the same restriction. A request with a grammar
(`grammar`: a token grammar, rollart.action_grammar; else `allowed_sequences`: an answer trie)
is restricted per step to the grammar's continuations of what the row generated so far.

Finishing, per row: the eos token (`<|im_end|>`, kept) -> "eos"; a stop string appearing in the
decoded generated text -> "stop" (tokens kept up to and including the token that completed it);
`max_new_tokens` reached -> "length"; aborted -> "abort" (see `abort`).

Emulated hardware (benchmarks only, off by default): on one CPU host every engine is the same
hardware, so to make routing between "compute" and "bandwidth" pools measurable the engine can
play a hardware class.
- `emulate=ServiceModel(...)` (rollart.routing.emulation; the default of `routing.emulation`):
  every forward pass takes the cost model's time for the class (prefill: prompt tokens x FLOPs
  per token / FLOP/s; decode step: weight bytes / bandwidth, shared by the batch's rows), spent
  as one sleep at the end of each batch, up to the modelled end of all its passes, so the real
  passes' CPU time is subtracted (any excess is counted in `emulated_overrun_s`).
  `forward=False` skips the real pass (uniform logits). The service time then depends on token
  counts only, not on the host's load.
- `emulate=Slowdown(prefill, decode)` (legacy): each pass is followed by a sleep of
  (factor - 1) x its measured time. A host busy with other work stretches the measured time, and
  the sleep stretches it by the same factor (issue 21: contention then decides the benchmark).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedTokenizerBase

from rollart.action_grammar import TokenTexts, token_texts, turn_walker
from rollart.engines.base import AbortSet, engine_stats
from rollart.routing.catalog import Slowdown
from rollart.routing.emulation import ServiceModel
from rollart.types import Completion, GenerationRequest


def sample_tokens(
    logits: Tensor, temperature: Tensor, top_p: Tensor, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Sample one token per row. logits [A, V]; temperature, top_p [A] -> tokens [A], logprobs [A].

    temperature <= 0 means greedy; log-probs then use temperature 1 (see module docstring).
    """
    greedy = temperature <= 0  # [A]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = F.log_softmax(logits.float() / temp[:, None], dim=-1)  # [A, V]
    tokens = logits.argmax(dim=-1)  # [A]
    if not bool(greedy.all()):
        probs = logp.exp()  # [A, V]
        if bool((top_p < 1).any()):
            sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)  # [A, V]
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # the top token always survives
            sorted_p = sorted_p.masked_fill(mass_before >= top_p[:, None], 0.0)
            choice = torch.multinomial(sorted_p, 1, generator=generator)  # [A, 1]
            sampled = sorted_idx.gather(-1, choice).squeeze(-1)
        else:
            sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _walks(req: GenerationRequest) -> bool:
    """Whether the request's allowed set changes per step (a token grammar or answer trie)."""
    return req.params.grammar is not None or req.params.allowed_sequences is not None


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> input_ids [B, T], attention_mask [B, T], position_ids [B, T] (pads at position 0)."""
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, T - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[b, T - len(p) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask, position_ids


class HFEngine:
    """InferenceEngine over a HF causal LM (or any module with the same forward signature).

    Requests are synchronous: `generate` runs to completion under a lock, so `update_weights`
    from another thread waits for the current call and never mixes versions in one completion.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int = 0,
        max_batch_size: int = 256,
        threads: int | None = None,
        weight_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        device: torch.device | str | None = None,
        emulate: Slowdown | ServiceModel | None = None,
    ):
        if threads is not None:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.tokenizer = tokenizer
        if device is None:
            device = next(iter(model.parameters()), torch.empty(0)).device
        self.device = torch.device(device)
        eos = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_ids = torch.tensor([e for e in eos if e is not None], dtype=torch.long)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_ids[0])
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.is_sleeping = False
        self._lock = threading.Lock()  # one generate / update_weights at a time
        self._aborted = AbortSet()
        self._texts: TokenTexts | None = None  # token texts, made on a first token grammar
        if isinstance(emulate, ServiceModel):  # params unset: time the served model itself
            emulate = emulate.with_params(sum(p.numel() for p in model.parameters()))
        self.emulate = emulate  # emulated hardware (see module docstring); None: off
        self._deadline = 0.0  # ServiceModel emulation: modelled end of the passes so far
        self._stats = {
            "requests": 0.0,
            "tokens_generated": 0.0,
            "prompt_tokens": 0.0,
            "generate_s": 0.0,
            "batches": 0.0,
            "aborted": 0.0,
            "sleeps": 0.0,
            "weight_updates": 0.0,
            "emulated_prefill_s": 0.0,  # Slowdown: sleep added (included in generate_s)
            "emulated_decode_s": 0.0,
            "emulated_sleep_s": 0.0,  # ServiceModel: sleep added (included in generate_s)
            "emulated_modelled_s": 0.0,  # ServiceModel: modelled service time of every pass
            "emulated_overrun_s": 0.0,  # ServiceModel: real passes that outran the modelled time
            "forward_s": 0.0,  # time inside the real forward passes
        }

    # ---------------------------------------------------------------- contract

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """One completion per request, in request order (aborted ones: finish_reason "abort")."""
        out: list[Completion | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                completions = self._generate_batch([requests[i] for i in chunk])
                for i, c in zip(chunk, completions, strict=True):
                    out[i] = c
        return out  # type: ignore[return-value]

    def update_weights(self, version: int, state_dict: Mapping[str, Tensor]) -> None:
        """Copy `state_dict` into the model in place (strict keys) and bump the version."""
        with self._lock:
            self.model.load_state_dict(dict(state_dict), strict=True)
            self.weight_version = version
            self._stats["weight_updates"] += 1

    def abort(self, request_ids: list[str]) -> None:
        """Generation is synchronous here, so abort is cooperative: ids are recorded (thread-safe)
        and a request that has not started yet is skipped, one that is running stops at its next
        decode step; either way its completion has finish_reason "abort"."""
        self._aborted.add(request_ids)

    def sleep(self) -> None:
        """Tracked no-op: a CPU HF model has nothing to offload."""
        self.is_sleeping = True
        self._stats["sleeps"] += 1

    def wake(self) -> None:
        self.is_sleeping = False

    def stats(self) -> dict[str, float]:
        return engine_stats(self._stats, self.weight_version)

    # ---------------------------------------------------------------- internals

    def _forward(self, input_ids: Tensor, mask: Tensor, pos: Tensor, cache: DynamicCache,
                 phase: str = "decode") -> Tensor:
        t0 = time.perf_counter()
        em = self.emulate
        pass_s = 0.0
        if isinstance(em, ServiceModel) and not em.forward:
            logits = torch.zeros((input_ids.shape[0], self._vocab()))  # uniform: no real pass
        else:
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :].float()  # [A, V]
            pass_s = time.perf_counter() - t0
            self._stats["forward_s"] += pass_s
        if isinstance(em, ServiceModel):  # the batch sleeps until the sum once, at its end
            rows = int(input_ids.shape[0])
            t = em.prefill_s(int(mask.sum())) if phase == "prefill" else em.decode_step_s(rows)
            self._deadline += t
            self._stats["emulated_modelled_s"] += t
        elif em is not None:
            factor = em.prefill if phase == "prefill" else em.decode
            if factor > 1.0:
                extra = (factor - 1.0) * pass_s
                time.sleep(extra)
                self._stats[f"emulated_{phase}_s"] += extra
        return logits

    def _vocab(self) -> int:
        emb = self.model.get_output_embeddings() if hasattr(
            self.model, "get_output_embeddings") else None
        if emb is not None and hasattr(emb, "out_features"):
            return int(emb.out_features)
        return int(self.model.config.vocab_size)

    def _allowed_mask(self, reqs: list[GenerationRequest], vocab: int,
                      gen: list[list[int]] | None = None) -> Tensor | None:
        """[A, V] bool, True where a row may sample its next token; None when no row is
        restricted. A row with a grammar (token grammar or answer trie, `turn_walker`: the
        trainer's own choice) gets its continuations of what the row has generated so far
        (`gen`, one list per row); otherwise its token bag."""
        if all(r.params.allowed_token_ids is None and not _walks(r) for r in reqs):
            return None
        mask = torch.ones((len(reqs), vocab), dtype=torch.bool)
        for j, r in enumerate(reqs):
            p = r.params
            walker = turn_walker(p.grammar, p.allowed_sequences,
                                 self._token_texts() if p.grammar is not None else None)
            if walker is not None:
                ids = walker.allowed_next(gen[j] if gen is not None else [])
            elif p.allowed_token_ids is not None:
                ids = p.allowed_token_ids
            else:
                continue
            mask[j] = False
            mask[j, torch.tensor(ids, dtype=torch.long)] = True
        return mask

    def _token_texts(self) -> TokenTexts:
        """The tokenizer's token texts, what token grammars are built over (made once)."""
        if self._texts is None:
            self._texts = token_texts(self.tokenizer)
        return self._texts

    def _stop_hit(self, token_ids: list[int], stops: list[str]) -> bool:
        # Decode only a tail window: a stop string of L chars spans at most L tokens (each token
        # decodes to >= 1 char), so L + 2 tokens always contain a stop string that ends here.
        window = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(token_ids[-window:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _generate_batch(self, reqs: list[GenerationRequest]) -> list[Completion]:
        t0 = time.perf_counter()
        B = len(reqs)
        gen: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        for b, r in enumerate(reqs):
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id!r} has an empty prompt")
            if self._aborted.take(r.request_id):
                finish[b] = "abort"
            elif r.params.max_new_tokens <= 0:
                finish[b] = "length"
        active = [b for b in range(B) if finish[b] is None]  # batch row -> request index

        self._deadline = time.perf_counter()  # ServiceModel emulation: the batch starts now
        real_pass = not (isinstance(self.emulate, ServiceModel) and not self.emulate.forward)
        if active:
            input_ids, mask, pos = left_pad([reqs[b].prompt_ids for b in active], self.pad_id)
            temperature = torch.tensor([reqs[b].params.temperature for b in active])  # [A]
            top_p = torch.tensor([reqs[b].params.top_p for b in active])  # [A]
            cache = DynamicCache(config=getattr(self.model, "config", None))
            logits = self._forward(input_ids, mask, pos, cache, "prefill")  # [A, V]
            allowed = self._allowed_mask([reqs[b] for b in active], logits.shape[-1])  # [A, V]
            # Only grammar rows change their allowed set per step; a bag is sliced.
            grammar = any(_walks(reqs[b]) for b in active)
            if allowed is not None:
                logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
            next_pos = pos[:, -1:] + 1  # [A, 1]
            while True:
                tokens, logprobs = sample_tokens(
                    logits, temperature.to(logits.device), top_p.to(logits.device), self.generator
                )
                is_eos = torch.isin(tokens.cpu(), self.eos_ids).tolist()
                tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
                keep: list[int] = []
                for j, b in enumerate(active):
                    r = reqs[b]
                    gen[b].append(tokens_l[j])
                    lps[b].append(logprobs_l[j])
                    if is_eos[j]:
                        finish[b] = "eos"
                    elif r.params.stop and self._stop_hit(gen[b], r.params.stop):
                        finish[b] = "stop"
                    elif len(gen[b]) >= r.params.max_new_tokens:
                        finish[b] = "length"
                    elif self._aborted.take(r.request_id):
                        finish[b] = "abort"
                    else:
                        keep.append(j)
                if not keep:
                    break
                if len(keep) < len(active):  # drop finished rows from every batched state
                    sel = torch.tensor(keep, dtype=torch.long)
                    if real_pass:
                        cache.batch_select_indices(sel.to(self.device))
                    mask, next_pos, tokens = mask[sel], next_pos[sel], tokens[sel.to(tokens.device)]
                    temperature, top_p = temperature[sel], top_p[sel]
                    if allowed is not None and not grammar:
                        allowed = allowed[sel]
                    active = [active[j] for j in keep]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [A, T + step]
                logits = self._forward(tokens[:, None], mask, next_pos, cache)
                if grammar:  # grammar rows move along their grammar each step
                    allowed = self._allowed_mask([reqs[b] for b in active], logits.shape[-1],
                                                 [gen[b] for b in active])
                if allowed is not None:
                    logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
                next_pos = next_pos + 1

        if isinstance(self.emulate, ServiceModel) and active:
            # One sleep per batch, until the modelled end of all its passes: only the batch's
            # return is visible outside, and one wake-up (not one per decode step) keeps the
            # timing exact on a loaded host. Real passes that outran the model: overrun.
            now = time.perf_counter()
            if self._deadline > now:
                time.sleep(self._deadline - now)
                self._stats["emulated_sleep_s"] += self._deadline - now
            else:
                self._stats["emulated_overrun_s"] += now - self._deadline
        dt = time.perf_counter() - t0
        self._stats["batches"] += 1
        self._stats["requests"] += B
        self._stats["generate_s"] += dt
        self._stats["tokens_generated"] += sum(len(g) for g in gen)
        self._stats["prompt_tokens"] += sum(len(r.prompt_ids) for r in reqs)
        self._stats["aborted"] += sum(f == "abort" for f in finish)
        return [
            Completion(
                request_id=r.request_id,
                token_ids=gen[b],
                logprobs=lps[b],
                text=self.tokenizer.decode(gen[b], skip_special_tokens=False),
                finish_reason=finish[b] or "length",
                weight_version=self.weight_version,
                prompt_tokens=len(r.prompt_ids),
                generate_s=dt,
            )
            for b, r in enumerate(reqs)
        ]
