"""The stage bodies of one RL iteration, free of Prefect: `tasks/` wraps each in a @task.

Torch and the model code are imported by the stages that use them, on the workers that run
them: the flow process imports this module to submit stages, and stays free of both
(tests/unit/test_light_imports.py).

Services are passed as handles (Dask actors in a run, or plain service objects in tests and
benchmarks), typed by their Protocols (`rollart/service_protocols.py`); `call(handle).method(...)`
hides the difference between an actor future and a direct return, and is checked by mypy.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from rollart.config import dump_config
from rollart.handles import (
    attach,
    call,
    call_timeout,
    call_while_present,
    set_call_timeout,
    worker_identity,
)
from rollart.metrics import reward_metrics, rollout_metrics
from rollart.rewards.client import make_reward_client
from rollart.rollout.env_manager import EpisodeSpec, constrained_params, run_episodes
from rollart.rollout.failover import is_replica_loss
from rollart.rollout.plan import plan_eval
from rollart.rollout.setup import sampling_params
from rollart.run import RunSpec
from rollart.runner.spans import timed_stage
from rollart.service_protocols import EngineAPI, RolloutAPI, TrainerAPI
from rollart.storage.background import shard_writer
from rollart.types import Completion, GenerationRequest, SamplingParams, Trajectory

P = ParamSpec("P")
R = TypeVar("R")


def run_stage(stage: str, *args: Any, call_timeout_s: float | None = None,
              after: Any = None) -> Any:
    """Stage `stage` with its actor handles re-attached (`rollart.handles.detach`): how a flow
    submits a stage as a raw Dask task without making it depend on every actor it calls.
    `call_timeout_s`: the run's call deadline, set in this worker process first (a worker
    that (re)joined mid-run has no service yet that would have set it). `after`: the values
    of stages that must end first (Dask futures when submitted; their values are unused)."""
    if call_timeout_s is not None:
        set_call_timeout(call_timeout_s)
    return globals()[stage](*attach(args))


def trajectories_of(x: list[Trajectory] | tuple[list[Trajectory], dict]) -> list[Trajectory]:
    """Stages hand on `(trajectories, info)`; accept that or a bare list."""
    return x[0] if isinstance(x, tuple) else x


@timed_stage
def prepare(run: RunSpec) -> dict[str, Any]:
    """The run's config and tokenizer into the store (once; env code, so on a CPU worker).
    It also loads the run's chat format on this worker, where the rollout service and the env
    hosts read it from the process's cache: a broken tokenizer fails here, and its imports
    (transformers, torch) run now, beside the engines' start, not after them."""
    from rollart.models.run_model import chat_format, prepare_tokenizer

    store = run.store()
    if not store.exists("config.yaml"):
        store.write_text("config.yaml", dump_config(run.cfg))
    vocab = prepare_tokenizer(run, store)
    chat_format(run)
    return {"vocab_size": vocab, "store": store.url, **worker_identity()}


def _run_on_engines(run: RunSpec, specs: list[EpisodeSpec], engines: list[EngineAPI],
                    params: SamplingParams,
                    on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
    """Split episodes across engine replicas (contiguous, so groups stay together)."""
    from rollart.models.run_model import chat_format

    chat = chat_format(run)
    n = len(engines)
    chunks = [specs[i * len(specs) // n:(i + 1) * len(specs) // n] for i in range(n)]
    per_task = constrained_params(params, chat, run.cfg.tasks, run.cfg.engine.answer_grammar)

    def generate(i: int, reqs: list[GenerationRequest]) -> list[Completion]:
        """On replica i, or the next one that answers when i is lost (a turn's request holds
        the whole conversation, so any replica can serve it)."""
        for k in range(n):
            try:
                return call(engines[(i + k) % n]).generate(reqs)
            except Exception as err:
                if not is_replica_loss(err) or k == n - 1:
                    raise
        raise AssertionError("unreachable")

    def on(i: int) -> list[Trajectory]:
        return run_episodes(chunks[i], lambda reqs: generate(i, reqs),
                            chat, per_task, run.max_context, on_done)

    if n == 1:
        return on(0)
    with ThreadPoolExecutor(n) as pool:
        return [t for part in pool.map(on, range(n)) for t in part]


@timed_stage
def collect(rollout: RolloutAPI, iteration: int) -> tuple[list[Trajectory], dict[str, Any]]:
    """The complete, scored groups for update `iteration` from the rollout service. Episodes
    ran (and were rewarded as each ended) while earlier updates trained, as far as
    `rollout.max_staleness` allows; this waits only for what is still missing."""
    t0 = time.perf_counter()
    # Waits for data, as long as rollouts take: no call deadline (episodes have their own),
    # but not past the loss of the rollout service's worker.
    trajs, info = call_while_present(rollout).take_batch(iteration)
    m = info["metrics"]
    m["perf/rollout_s"] = time.perf_counter() - t0  # time the trainer waited for rollouts
    return trajs, {**info, **worker_identity()}


@timed_stage
def score(run: RunSpec, iteration: int,
          collected: Any) -> tuple[list[Trajectory], dict[str, Any]]:
    """Rewards, then group-normalised advantages; failed episodes are dropped here."""
    import torch

    from rollart.algo import get_advantage_estimator, zero_variance_groups

    cfg = run.cfg
    t0 = time.perf_counter()
    trajs = trajectories_of(collected)
    ok = [t for t in trajs if t.error is None]
    # Failed episodes never reach the trainer: the ledger records them as dropped.
    dropped = [(t.sample_id, t.iteration, "env_error") for t in trajs if t.error is not None]
    if isinstance(collected, tuple):  # failed, cancelled and stale episodes of the service
        dropped += [tuple(d) for d in collected[1].get("dropped", [])]
    unscored = [t for t in ok if t.reward is None]  # normally none: collect invoked them
    if unscored:
        make_reward_client(cfg.reward).score(unscored)
    rewards = torch.tensor([t.reward for t in ok], dtype=torch.float32)
    groups = [t.group_id for t in ok]
    estimator = get_advantage_estimator(cfg.algo.advantage)
    adv = estimator(rewards, groups, normalize_std=cfg.algo.normalize_std,
                    std_eps=cfg.algo.std_eps) if ok else torch.zeros(0)
    for t, a in zip(ok, adv.tolist(), strict=True):
        t.advantage = a
    m = reward_metrics(ok, len(zero_variance_groups(rewards, groups)) if ok else 0)
    if cfg.storage.shards and ok:  # Parquet shard, uploaded off the critical path
        store, shard = run.store(), list(ok)
        m["perf/shard_wait_s"] = shard_writer().submit(
            f"shard {iteration}", lambda: store.write_shard(iteration, shard))
    m["perf/score_s"] = time.perf_counter() - t0
    return ok, {"metrics": m, "dropped": dropped, **worker_identity()}


@timed_stage
def update(trainer: TrainerAPI, scored: Any, step: int | None = None) -> dict[str, Any]:
    """The policy update `step` (the trainer refuses any other than its next one)."""
    t0 = time.perf_counter()
    dropped = scored[1].get("dropped") if isinstance(scored, tuple) else None
    # Slow is not lost: past the call deadline it goes on while the trainer's worker beats.
    out = call(trainer, while_alive=True).update(trajectories_of(scored), dropped, step)
    out["metrics"]["perf/update_s"] = time.perf_counter() - t0
    return {**out, "caller": worker_identity()}


@timed_stage
def sync_weights(trainer: TrainerAPI, engines: list[EngineAPI], rollout: RolloutAPI | None = None,
                 step: int | None = None) -> dict[str, Any]:
    """Trainer -> engines, worker to worker through this task (runs on an engine worker), or
    through the store (`storage.sync_via_store`: trainer publishes weights/v{n}, engines pull).
    Each engine switches between two `generate` calls: turns in flight finish on the old version
    (their tokens record it). Then the rollout service learns that update `step` is done
    (its staleness clock counts updates; a skipped update leaves the weight version alone)."""
    out = push_weights(trainer, engines)
    if rollout is not None:
        call(rollout).set_version(out["version"] if step is None else step)
    return out


def _tolerant(method: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R | None:
    """A call to an engine replica (`_tolerant(call(engine).method, *args)`); None when the
    replica turns out to be lost (its worker died or hung past the deadline): the rollout
    service fails it over, the supervisor brings it back (rollart/runner/recovery.py), and this
    stage goes on with the others."""
    try:
        return method(*args, **kwargs)
    except Exception as err:
        if is_replica_loss(err):
            return None
        raise


def push_weights(trainer: TrainerAPI, engines: list[EngineAPI]) -> dict[str, Any]:
    """The trainer's current weights into `engines`; a replica lost on the way is skipped
    (`skipped`: positions in `engines`, `perf/sync_skipped`)."""
    t0 = time.perf_counter()
    if call(trainer).sync_via_store():
        pub = call(trainer).publish_weights()
        got = [_tolerant(call(e).pull_weights, pub["version"]) for e in engines]
        pulls = [p for p in got if p is not None]
        return {
            "version": pub["version"],
            "skipped": [i for i, p in enumerate(got) if p is None],
            "metrics": {"perf/sync_s": time.perf_counter() - t0,
                        "perf/sync_pause_s": max((p["pause_s"] for p in pulls), default=0.0),
                        "perf/sync_skipped": float(len(got) - len(pulls)),
                        "perf/sync_bytes": float(pub["bytes"]),
                        "perf/weights_store_bytes": float(pub["bytes"]) * (1 + len(engines)),
                        "perf/weights_publish_s": pub["publish_s"],
                        "perf/weights_pull_s": max((p["pull_s"] for p in pulls),
                                                   default=0.0)},
            **worker_identity(),
        }
    # Same host: engines copy from the trainer's /dev/shm file; every other engine gets the
    # weights straight from the trainer's process, streamed along a chain of engines.
    shared = call(trainer).share_weights() if call(trainer).shared_memory_sync() else None
    pauses: list[float] = []
    skipped: list[int] = []
    remote: list[int] = []
    via_shm = 0
    for i, e in enumerate(engines):
        try:  # None from the call: it cannot map the file (another host)
            out = call(e).load_shared_weights(shared) if shared else None
        except Exception as err:
            if not is_replica_loss(err):
                raise
            skipped.append(i)
            continue
        if out is None:
            remote.append(i)
        else:
            via_shm += 1
            pauses.append(out["pause_s"])
    streamed = _stream(trainer, engines, remote, skipped) if remote else {}
    pauses += streamed.get("pauses", [])
    if shared:
        version = shared["version"]
    elif streamed.get("version") is not None:
        version = streamed["version"]
    else:  # nothing was sent (every replica lost): still say which version is current
        version = call(trainer).weight_version()
    return {
        "version": version,
        "skipped": sorted(skipped),
        "metrics": {"perf/sync_s": time.perf_counter() - t0,
                    "perf/sync_pause_s": max(pauses, default=0.0),
                    "perf/sync_skipped": float(len(skipped)),
                    "perf/sync_bytes": float(shared["bytes"]) if shared else float(
                        streamed.get("bytes", 0.0)),
                    "perf/sync_shm_engines": float(via_shm),
                    "perf/sync_stream_engines": float(streamed.get("engines", 0)),
                    "perf/sync_stream_s": float(streamed.get("seconds", 0.0))},
        **worker_identity(),
    }


def _stream(trainer: TrainerAPI, engines: list[EngineAPI], which: list[int],
            skipped: list[int]) -> dict[str, Any]:
    """Weights from the trainer's process to engines `which`, one pipelined stream through
    them all (rollart/engines/weight_stream.py): the flow process passes only addresses and a
    random token. A replica lost on the way is added to `skipped` and the stream is sent again
    without it (once)."""
    timeout_s = float(call_timeout() or 600.0)
    for attempt in range(2):
        token = secrets.token_bytes(32)
        chain: list[tuple[int, tuple[str, int]]] = []
        for i in which:
            addr = _tolerant(call(engines[i]).open_weight_stream, token, timeout_s)
            if addr is None:
                skipped.append(i)
            else:
                chain.append((i, (addr[0], addr[1])))
        if not chain:
            return {}
        try:
            sent = call(trainer, while_alive=True).stream_weights([a for _, a in chain], token,
                                                                  timeout_s)
            outs = [(i, _tolerant(call(engines[i]).finish_weight_stream, timeout_s))
                    for i, _ in chain]
        except Exception:
            for i, _ in chain:
                _tolerant(call(engines[i]).abort_weight_stream)
            lost = [i for i, _ in chain
                    if _tolerant(call(engines[i]).weight_version) is None]
            if attempt == 1 or not lost:
                raise
            skipped.extend(lost)
            which = [i for i, _ in chain if i not in lost]
            continue
        skipped.extend(i for i, o in outs if o is None)
        return {"version": sent["version"], "bytes": sent.get("bytes", 0.0),
                "seconds": sent.get("seconds", 0.0), "engines": len(chain),
                "pauses": [o["pause_s"] for _, o in outs if o is not None]}
    return {}


@dataclass(frozen=True)
class CheckpointSaved:
    """What the driver reads of the checkpoint stage's info dict (`CheckpointSaved.of`); the
    dict itself (`info`) is what the run records (flow artifacts, IterationResult.checkpoint)."""

    path: str
    save_s: float  # the snapshot's blocking part; the upload runs in the background
    upload_s: tuple[float, ...]  # background uploads that finished since the last checkpoint
    info: dict[str, Any]

    @classmethod
    def of(cls, info: dict[str, Any]) -> CheckpointSaved:
        return cls(path=str(info["path"]), save_s=float(info["save_s"]),
                   upload_s=tuple(float(up["result"]["upload_s"])
                                  for up in info.get("uploaded", [])),
                   info=info)


@timed_stage
def checkpoint(trainer: TrainerAPI, step: int, meta: dict[str, Any],
               engines: list[EngineAPI | None] | None = None,
               rollout: RolloutAPI | None = None) -> dict[str, Any]:
    """Snapshot trainer state, sample ledger, the engines' sampling RNG (exact resume) and the
    rollout service's unconsumed groups (async runs: rollart/rollout/snapshot.py); the trainer
    uploads it in the background, so this returns before the upload ends."""
    # A lost replica's slot (None, or lost on the way) records no state: it resumes unseeded.
    engine_rng = [(_tolerant(call(e).rng_state) if e is not None else None) or b""
                  for e in engines or []]
    state, pending = call(rollout).snapshot() if rollout is not None else (None, [])
    saved = call(trainer, while_alive=True).save_checkpoint(step, meta, engine_rng or None,
                                                             pending or None, state)
    return {**saved, "caller": worker_identity()}


@timed_stage
def load_checkpoint_weights(engine: EngineAPI, step: int) -> dict[str, Any]:
    """Evaluation of a finished run: the engine serves checkpoint `step` (verified)."""
    return call(engine).load_checkpoint(step)


def restore(trainer: TrainerAPI, engines: list[EngineAPI], step: int) -> dict[str, Any]:
    """Load checkpoint `step` into the trainer (weights, optimizer, RNG, ledger) and the engines'
    sampling RNG; the caller then syncs weights so the engines serve the restored version."""
    info = call(trainer, while_alive=True).load_checkpoint(step)
    info["engine_rng_restored"] = [call(e).restore_rng(step) for e in engines]
    return info


@timed_stage
def evaluate(run: RunSpec, engines: list[EngineAPI], episodes: int) -> dict[str, Any]:
    """Greedy episodes on held-out seeds."""
    t0 = time.perf_counter()
    if not engines:  # every replica is lost at the moment: skip, say so
        return {"metrics": {"eval/skipped": 1.0}, **worker_identity()}
    trajs = _run_on_engines(run, plan_eval(run.cfg, episodes), engines,
                            sampling_params(run.cfg, greedy=True))
    m = rollout_metrics(trajs, prefix="eval")
    m["perf/eval_s"] = time.perf_counter() - t0
    return {"metrics": m, **worker_identity()}
