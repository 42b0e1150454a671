"""The rollout service's side of hardware-affinity routing (rollart/routing/router.py).

Thread-safe glue between episode threads, engine batchers and the pure Router: every turn is
routed from its prefill/decode estimate (new prompt tokens now, decode tokens from the task's
online profile), each engine call reports its busy time (the router's online correction), and
every finished episode feeds the task profiles (`rollout/profile/...`). With one engine, or
lockstep batching, turns stay on the replica the episode started on.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from rollart.config import RunConfig
from rollart.routing.router import RouteRequest
from rollart.routing.setup import build_router, engine_replica_id, task_profiles
from rollart.types import GenerationRequest, Trajectory


class TurnRouter:
    def __init__(self, cfg: RunConfig, param_count: Callable[[], float], dynamic: bool) -> None:
        self.cfg, self.dynamic = cfg, dynamic
        self.profiles = task_profiles(cfg)
        self.router = build_router(cfg, param_count()) if dynamic else None
        self.lock = threading.Lock()
        self.placed: Counter[tuple[str, str]] = Counter()  # (task, hardware class) -> turns

    def route(self, episode_id: str, task: str, req: GenerationRequest, new_tokens: int,
              default: int) -> int:
        """The engine replica index for this turn."""
        if self.router is None:
            return default
        with self.lock:
            d = self.router.route(RouteRequest(
                req.request_id, episode_id, task, new_tokens=new_tokens,
                context_tokens=len(req.prompt_ids) - new_tokens,
                decode_tokens=self.profiles.expected_decode_tokens(
                    task, prior=req.params.max_new_tokens)))
            self.placed[(task, d.hw_class)] += 1
        return d.replica_index  # engine_replicas lists the replicas in engine order

    def served(self, engine: int, request_ids: list[str], busy_s: float) -> None:
        if self.router is None:
            return
        with self.lock:
            self.router.on_batch(engine_replica_id(engine), request_ids, busy_s)
            for rid in request_ids:
                self.router.on_finished(rid)

    def failed(self, engine: int) -> None:
        """Replica `engine` is lost: the router stops choosing it, and its episodes' next
        turns are placed elsewhere (counted as failovers)."""
        if self.router is not None:
            with self.lock:
                self.router.on_failed(engine_replica_id(engine))

    def recovered(self, engine: int) -> None:
        if self.router is not None:
            with self.lock:
                self.router.on_recovered(engine_replica_id(engine))

    def abandon(self, request_id: str) -> None:
        """A turn that failed with the engine's own error leaves the replica's queue."""
        if self.router is not None:
            with self.lock:
                self.router.on_finished(request_id)

    def episode_end(self, episode_id: str, task: str, traj: Trajectory) -> None:
        with self.lock:
            for turn in traj.turns:
                self.profiles.observe_turn(task, turn.prompt_tokens, turn.completion_tokens)
                self.profiles.observe_env_step(task, turn.env_s)
            if self.router is not None:
                self.router.on_episode_end(episode_id)

    def metrics(self) -> dict[str, float]:
        with self.lock:
            out = self.profiles.metrics()
            if self.router is not None:
                out.update({f"rollout/{k}": float(v) for k, v in self.router.metrics().items()})
                for (task, hw), n in self.placed.items():  # where each task's turns ran
                    out[f"rollout/router/{task}/turns_on/{hw}"] = float(n)
        return out
