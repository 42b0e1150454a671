"""Episodes as threads: the rollout service's `rollout.runner: threads` (the default).

Each live episode runs on its own Python thread, start to end; the service's engine batchers
(rollart/rollout/batcher.py) and its env-timeout watchdog are threads too. The asyncio runner
(rollart/rollout/aio_runner.py) runs the same steps as tasks on one event loop.
"""

from __future__ import annotations

import time
from typing import Any

from rollart.rollout.batcher import EpisodeCancelled, LiveEpisode
from rollart.rollout.env_host import HostedEnv
from rollart.rollout.env_manager import (
    EpisodeSpec,
    apply_completion,
    constrain,
    finish_episode,
    start_episode,
)
from rollart.rollout.failover import NoReplicaLeft, is_replica_loss
from rollart.routing.router import NoHealthyReplica
from rollart.types import Completion, GenerationRequest, Trajectory


def run_episode(svc: Any, live: LiveEpisode) -> None:
    """One episode on its own thread, start to end (RolloutService._launch spawns it)."""
    st = live.start
    params = svc.params[st.task]
    spec = EpisodeSpec(svc.tasks[st.task], st.seed, st.group_id, st.episode_id, st.iteration)
    env = HostedEnv(svc, live)
    ep = start_episode(spec, svc.chat, lambda task: env)
    reason = "env_error"
    constrain(ep.traj, params)
    try:
        while not ep.done and not live.cancelled:
            req = GenerationRequest(f"{st.episode_id}#t{ep.traj.num_turns}",
                                    list(ep.traj.token_ids), params)
            t0 = time.perf_counter()
            comp = _generate(svc, live, req, ep.pending_prompt_tokens)
            ep.timings["generate_s"] += time.perf_counter() - t0
            if comp is None:
                break  # stopping with no replica left
            if not live.cancelled:
                apply_completion(ep, comp, svc.chat, svc.max_context, params.max_new_tokens)
    except EpisodeCancelled:
        pass
    except NoReplicaLeft as err:  # the run cannot go on: say why
        svc.set_fatal(err)
        live.cancelled = True
    except Exception as err:  # the engine's own error: costs this episode, not the replica
        ep.traj.error = f"generate: {type(err).__name__}: {err}"
        reason = "engine_error"
    env.close()
    traj = finish_episode(ep)
    if svc.episode_over(live, traj, ep.timings, reason):
        _score(svc, live, traj)

def _generate(svc: Any, live: LiveEpisode, req: GenerationRequest, new_tokens: int
              ) -> Completion | None:
    """One turn on a serving replica. A replica lost on the way is marked and the same
    request goes to another (the episode's tokens stop at its last completed turn, so
    nothing is generated twice and every kept token keeps its version); None once the
    service stops while no replica is left."""
    while True:
        alive = svc.health.wait_any(lambda: svc.stopping or live.cancelled)
        if not alive:
            return None
        if live.engine not in alive:  # its replica is gone: the least loaded alive one
            svc.move_engine(live, alive)
        try:
            engine = svc.routing.route(live.id, live.start.task, req, new_tokens,
                                        live.engine)
        except NoHealthyReplica:  # the router heard of a loss before the health flags
            time.sleep(0.05)
            continue
        try:
            return svc.batchers[engine].generate(req, live)
        except EpisodeCancelled:
            raise
        except Exception as err:
            if not is_replica_loss(err):
                svc.routing.abandon(req.request_id)
                raise
            svc.engine_lost(engine, err)
            svc.totals.counters["turns_reissued"] += 1

def _score(svc: Any, live: LiveEpisode, traj: Trajectory) -> None:
    try:
        svc.reward.submit(traj).result()
    except Exception as err:  # the reward backend's own policy (retries, on_error) is spent
        svc.set_fatal(err, keep_first=False)
        return
    svc._scored(live, traj)

