"""Episodes as threads: the rollout service's `rollout.runner: threads` (the default).

Each live episode runs on its own Python thread, start to end; the service's engine batchers
(rollart/rollout/batcher.py) and its env-timeout watchdog are threads too. The asyncio runner
(rollart/rollout/aio_runner.py) runs the same steps as tasks on one event loop.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from rollart.rollout.batcher import LiveEpisode
from rollart.rollout.env_host import HostedEnv
from rollart.rollout.episode_step import (
    Action,
    Generate,
    Step,
    open_env,
    reissue_turn,
    route_turn,
    service_steps,
    take,
)
from rollart.types import Completion, GenerationRequest, Trajectory


def run_episode(svc: Any, live: LiveEpisode) -> None:
    """One episode on its own thread, start to end (RolloutService._launch spawns it); its
    turns and what a failure costs are rollart/rollout/episode_step.py's."""
    env = HostedEnv(svc, live)
    steps = service_steps(svc, live)
    perform = partial(_perform, svc, live, env)
    action = steps.start()
    while action is not None:
        action = take(steps, action, perform)
    env.close()
    traj = steps.finish()
    if svc.episode_over(live, traj, steps.timings, steps.reason):
        _score(svc, live, traj)


def _perform(svc: Any, live: LiveEpisode, env: HostedEnv, action: Action) -> Any:
    if type(action) is Generate:
        return _generate(svc, live, action.request, action.new_tokens)
    if type(action) is Step:
        return env.step(action.text)
    return open_env(env, live.start.seed)


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
        engine = route_turn(svc, live, req, new_tokens)
        if engine is None:  # the router heard of a loss before the health flags
            time.sleep(0.05)
            continue
        try:
            return svc.batchers[engine].generate(req, live)
        except Exception as err:
            if not reissue_turn(svc, engine, req, err):
                raise


def _score(svc: Any, live: LiveEpisode, traj: Trajectory) -> None:
    try:
        svc.reward.submit(traj).result()
    except Exception as err:  # the reward backend's own policy (retries, on_error) is spent
        svc.set_fatal(err, keep_first=False)
        return
    svc._scored(live, traj)

