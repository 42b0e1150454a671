"""What the simulator plays: tasks, engines, trainer and the rollout settings (typed, validated).

Everything is in simulated seconds. Env step latency reuses `LatencyConfig` (and its `sample`,
the formula `LatencyEnv` sleeps), so a task's latency block in a run config can be copied here
as is. Episodes are planned when they start (`EpisodePlan`: turns, step delays, failing step), so
a test can also hand the simulator exact plans instead of sampled ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from rollart.config import LatencyConfig
from rollart.config.training import rollout_defaults
from rollart.rollout.scheduler import SchedulerConfig, split_by_share

_ROLLOUT = rollout_defaults()  # the defaults of `rollout.*`, from their one home


class SimConfigError(ValueError):
    """A simulator input is out of range; the message names the field."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise SimConfigError(message)


@dataclass(frozen=True)
class TaskModel:
    """One task: its share of each batch, how many turns its episodes take, how its env steps
    behave. Turns are uniform over `turns` (inclusive range) unless `turn_probs` is given:
    turn_probs[k] is the probability of k + 1 turns."""

    name: str
    share: float = 1.0
    turns: tuple[int, int] = (1, 1)
    turn_probs: tuple[float, ...] | None = None
    fail_prob: float = 0.0  # per env step: the step raises and the episode fails
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    # Tokens, for engines priced by the hardware cost model (rollart.sim.system); 0: unpriced.
    first_prompt_tokens: int = 0  # the first turn's prompt
    obs_tokens: int = 0  # prompt tokens each later turn adds (observation / tool output)
    decode_tokens: float = 0.0  # mean tokens generated per turn
    decode_sigma: float = 0.0  # lognormal spread of a turn's decode length (0: always the mean)
    decode_max: float = 0.0  # cap on a turn's decode length (max_new_tokens; 0: none)

    def __post_init__(self) -> None:
        where = f"task {self.name!r}"
        _check(bool(self.name), "task name must be non-empty")
        _check(self.share > 0, f"{where}: share must be > 0 (got {self.share})")
        lo, hi = self.turns
        _check(1 <= lo <= hi, f"{where}: turns must be (min, max) with 1 <= min <= max "
                              f"(got {self.turns})")
        if self.turn_probs is not None:
            probs = tuple(float(p) for p in self.turn_probs)
            _check(len(probs) > 0 and all(p >= 0 for p in probs),
                   f"{where}: turn_probs must be non-negative, at least one")
            _check(math.isclose(sum(probs), 1.0, abs_tol=1e-9),
                   f"{where}: turn_probs must sum to 1 (got {sum(probs)})")
            object.__setattr__(self, "turn_probs", probs)
        _check(0.0 <= self.fail_prob < 1.0,
               f"{where}: fail_prob must be in [0, 1) (got {self.fail_prob})")
        _check(isinstance(self.latency, LatencyConfig),
               f"{where}: latency must be a rollart.config.LatencyConfig")
        _check(min(self.first_prompt_tokens, self.obs_tokens) >= 0 and self.decode_tokens >= 0
               and self.decode_sigma >= 0 and self.decode_max >= 0,
               f"{where}: token counts, decode_sigma and decode_max must be >= 0")

    def sample_turns(self, rng: random.Random) -> int:
        if self.turn_probs is not None:
            return rng.choices(range(1, len(self.turn_probs) + 1), self.turn_probs)[0]
        return rng.randint(*self.turns)


@dataclass(frozen=True)
class EngineModel:
    """One inference replica: a `generate` call over k queued turns takes
    overhead_s + k * per_request_s; calls run back to back, at most max_batch turns each.
    Continuous batching waits `batch_wait_s` for more turns when a call would not be full
    (the real batcher's `rollout.batch_wait_s`)."""

    overhead_s: float = 0.0
    per_request_s: float = 0.0
    max_batch: int = 256
    batch_wait_s: float = 0.0

    def __post_init__(self) -> None:
        _check(self.overhead_s >= 0, f"engine.overhead_s must be >= 0 (got {self.overhead_s})")
        _check(self.per_request_s >= 0,
               f"engine.per_request_s must be >= 0 (got {self.per_request_s})")
        _check(self.max_batch >= 1, f"engine.max_batch must be >= 1 (got {self.max_batch})")
        _check(self.batch_wait_s >= 0,
               f"engine.batch_wait_s must be >= 0 (got {self.batch_wait_s})")
        _check(self.overhead_s + self.per_request_s > 0,
               "engine: a generate call must take time (overhead_s or per_request_s > 0)")

    def call_s(self, k: int) -> float:
        return self.overhead_s + k * self.per_request_s


@dataclass(frozen=True)
class TrainerModel:
    """One update takes update_s of trainer time; the weight sync after it takes sync_s, and the
    engines serve nothing during it (a call in progress finishes first: stages.sync_weights)."""

    update_s: float
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        _check(self.update_s >= 0, f"trainer.update_s must be >= 0 (got {self.update_s})")
        _check(self.sync_s >= 0, f"trainer.sync_s must be >= 0 (got {self.sync_s})")


@dataclass(frozen=True)
class SimConfig:
    """The rollout settings mirror `rollout.*` of a run config (same names, same meaning, same
    defaults: taken from `RolloutConfig`, their one home)."""

    tasks: tuple[TaskModel, ...]
    engine: EngineModel
    trainer: TrainerModel
    # Rollout settings: `rollout.*` of a run config, with its defaults (their one home).
    group_size: int = _ROLLOUT["group_size"]
    num_groups: int = _ROLLOUT["num_groups"]
    max_staleness: int = _ROLLOUT["max_staleness"]
    redundancy: int = _ROLLOUT["redundancy"]
    max_retries: int = _ROLLOUT["max_retries"]
    max_consecutive_failures: int = _ROLLOUT["max_consecutive_failures"]
    engines: int = 1
    iterations: int = 10
    batching: Literal["continuous", "lockstep"] = _ROLLOUT["batching"]
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        _check(len(self.tasks) > 0, "tasks: at least one task")
        _check(all(isinstance(t, TaskModel) for t in self.tasks), "tasks: TaskModel items")
        names = [t.name for t in self.tasks]
        _check(len(set(names)) == len(names), f"tasks: names must be unique (got {names})")
        for name, lo in (("group_size", 1), ("num_groups", 1), ("max_staleness", 0),
                         ("redundancy", 0), ("max_retries", 0), ("max_consecutive_failures", 0),
                         ("engines", 1), ("iterations", 1)):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= lo,
                   f"{name} must be an integer >= {lo} (got {value!r})")
        _check(self.batching in ("continuous", "lockstep"),
               f"batching must be 'continuous' or 'lockstep' (got {self.batching!r})")
        counts = split_by_share(self.num_groups, [t.share for t in self.tasks])
        for t, n in zip(self.tasks, counts, strict=True):
            _check(n > 0, f"task {t.name!r} gets 0 of num_groups={self.num_groups} groups per "
                          f"batch: raise num_groups or its share")

    def scheduler_config(self) -> SchedulerConfig:
        """The same SchedulerConfig the rollout service builds from a run config."""
        return SchedulerConfig(
            group_size=self.group_size, batch_groups=self.num_groups,
            max_staleness=self.max_staleness, redundancy=self.redundancy,
            max_retries=self.max_retries, max_updates=self.iterations,
            max_consecutive_failures=self.max_consecutive_failures,
            task_shares=tuple((t.name, t.share) for t in self.tasks))


@dataclass(frozen=True)
class EpisodePlan:
    """How one episode will go: `step_s[i]` is the env latency after turn i; the episode fails
    at env step `fail_at` (0-based; None: it finishes after len(step_s) turns)."""

    step_s: tuple[float, ...]
    fail_at: int | None = None
    decode: tuple[float, ...] = ()  # tokens generated per turn (priced engines only)

    def __post_init__(self) -> None:
        _check(len(self.step_s) >= 1 and all(s >= 0 for s in self.step_s),
               "EpisodePlan.step_s: at least one turn, delays >= 0")
        _check(not self.decode or len(self.decode) == len(self.step_s),
               "EpisodePlan.decode: one entry per turn (or none)")
        _check(self.fail_at is None or 0 <= self.fail_at < len(self.step_s),
               f"EpisodePlan.fail_at must index a step (got {self.fail_at})")


def sample_plan(task: TaskModel, rng: random.Random) -> EpisodePlan:
    """Turns, then each step's delay, whether it fails, then decode lengths (drawn in that
    order, from `rng`; the decode draws come last so unpriced workloads replay as before)."""
    n = task.sample_turns(rng)
    steps = tuple(task.latency.sample(rng) for _ in range(n))
    fail_at = None
    if task.fail_prob:
        fail_at = next((i for i in range(n) if rng.random() < task.fail_prob), None)
    decode: tuple[float, ...] = ()
    if task.decode_tokens:
        # Lognormal around the mean (median mean * exp(-sigma^2 / 2)): long answers are rare
        # but long, which is what makes synchronous batches wait for their slowest member.
        mu, sigma = -task.decode_sigma ** 2 / 2, task.decode_sigma
        cap = task.decode_max or float("inf")
        decode = tuple(min(cap, max(1.0, round(task.decode_tokens * rng.lognormvariate(mu, sigma))))
                       if sigma else min(cap, task.decode_tokens) for _ in range(n))
    return EpisodePlan(steps, fail_at, decode)
