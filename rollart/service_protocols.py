"""The typed seams between the iteration driver, the stages and the long-lived services.

Each Protocol lists the methods the driver, the stages and the recovery code call on a service,
with the service's real signature. A handle is typed by its Protocol whether it is the plain
object (in-process mode, tests) or a Dask actor standing for it: a call goes through
`rollart.handles.call`, whose typed form `call(handle).method(*args)` returns what the method
returns, so a type checker (mypy, `make typecheck`) verifies the method's name, its arguments and
how its answer is used, e.g.

    out = call(trainer, while_alive=True).update(trajs, dropped, step)   # dict[str, Any]

A Dask actor's method returns a future, not the value: only `call` may invoke a handle's
methods (it waits for the answer, with the call deadline and the errors of `rollart.handles`).

Conforming classes (checked by mypy below): `TrainerService` and `TrainerGroup` are
`TrainerAPI`; `EngineService` is `EngineAPI`; `RolloutService` and `ShardedRollout` are
`RolloutAPI` (`RolloutServiceActor` answers the same calls as a Dask actor; its `take_batch` is
a coroutine there, which the actor runs to its value).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

from rollart.types import Completion, GenerationRequest, Trajectory

Batch = tuple[list[Trajectory], dict[str, Any]]  # trajectories and their info (`metrics`, ...)
Dropped = list[tuple[str, int, str]]  # (sample id, iteration, reason) of samples not trained on


# ---- what a weight sync's calls answer (read by field in rollart/runner/stages.py) ---------------
# Plain dicts at run time (they cross Dask as they always did); typed here so that a misspelled
# key is a type error.

class WeightsPublished(TypedDict):
    """`publish_weights`: the current version written to the store's `weights/v{n}/`."""

    version: int
    bytes: float
    publish_s: float


class SharedWeights(TypedDict):
    """`share_weights`: the descriptor of the trainer's shared-memory weights file
    (`rollart/engines/shared_weights.py`), handed to engines as it is."""

    path: str
    host: str
    version: int
    layout: Any
    bytes: int


class _StreamStats(TypedDict, total=False):
    bytes: float
    seconds: float


class WeightsStreamedOut(_StreamStats):
    """`stream_weights`: what the trainer sent down the chain of engines (rank 0's stats)."""

    version: int


class WeightsLoaded(TypedDict):
    """An engine now serves `version`; generation paused `pause_s` for the load."""

    version: float
    pause_s: float


class WeightsPulled(WeightsLoaded):
    """`pull_weights`: loaded from the store."""

    pull_s: float
    bytes: float


class WeightsStreamedIn(WeightsLoaded):
    """`finish_weight_stream`: received from the trainer's stream."""

    stream_s: float
    bytes: float


class TrainerAPI(Protocol):
    """The trainer service (one rank, `rollart/services/trainer.py`, or a sharded group,
    `rollart/services/trainer_group.py`)."""

    def update(self, trajs: list[Trajectory], dropped: Dropped | None = None,
               step: int | None = None) -> dict[str, Any]: ...

    def export_weights(self) -> tuple[int, dict[str, Any]]: ...  # (version, tensors)

    def stream_weights(self, chain: list[tuple[str, int]], token: bytes,
                       timeout_s: float) -> WeightsStreamedOut: ...

    def weight_version(self) -> int: ...

    def share_weights(self) -> SharedWeights: ...

    def shared_memory_sync(self) -> bool: ...

    def sync_via_store(self) -> bool: ...

    def publish_weights(self) -> WeightsPublished: ...

    def save_checkpoint(self, step: int, meta: dict[str, Any],
                        engine_rng: list[bytes] | None = None,
                        pending: list[Trajectory] | None = None,
                        rollout_state: bytes | None = None) -> dict[str, Any]: ...

    def flush_checkpoints(self, timeout: float | None = None) -> list[dict[str, Any]]: ...

    def load_checkpoint(self, step: int) -> dict[str, Any]: ...

    def take_pending(self) -> list[Trajectory]: ...

    def take_rollout_state(self) -> tuple[bytes | None, list[Trajectory]]: ...

    def ledger_records(self) -> list[list[Any]]: ...

    def fingerprint(self) -> float: ...

    def where(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class EngineAPI(Protocol):
    """One inference engine replica (`rollart/services/engine.py`)."""

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]: ...

    def load_shared_weights(self, desc: SharedWeights) -> WeightsLoaded | None: ...

    def open_weight_stream(self, token: bytes, timeout_s: float) -> tuple[str, int]: ...

    def finish_weight_stream(self, timeout_s: float) -> WeightsStreamedIn: ...

    def abort_weight_stream(self) -> None: ...

    def pull_weights(self, version: int) -> WeightsPulled: ...

    def load_checkpoint(self, step: int) -> dict[str, Any]: ...

    def rng_state(self) -> bytes: ...

    def restore_rng(self, step: int) -> bool: ...

    def weight_version(self) -> int: ...

    def param_count(self) -> float: ...

    def fingerprint(self) -> float: ...

    def stats(self) -> dict[str, Any]: ...

    def where(self) -> dict[str, Any]: ...


class RolloutAPI(Protocol):
    """The rollout service (`rollart/rollout/service.py`, as the Dask actor of
    `rollart/services/rollout.py`, or `n` shards behind `rollart/rollout/shards.py`)."""

    def start(self) -> dict[str, Any] | None: ...  # the actor answers where it runs

    def take_batch(self, update: int) -> Batch: ...

    def try_take(self, update: int) -> Batch | None: ...

    def set_version(self, version: int) -> None: ...

    def lost_engines(self) -> list[int]: ...

    def replace_engine(self, index: int, engine: Any) -> None: ...

    def snapshot(self) -> tuple[bytes | None, list[Trajectory]]: ...

    def restore_state(self, state: bytes, trajs: list[Trajectory]) -> dict[str, int]: ...

    def stats(self) -> dict[str, Any]: ...

    def stop(self) -> dict[str, Any]: ...


@runtime_checkable
class ReplacesEngines(Protocol):
    """A service factory whose engine replicas live on workers that can be lost, and that can
    build a replacement (`rollart/runner/dask_services.py`): the driver then runs an engine
    supervisor (`rollart/runner/recovery.py`). `isinstance` checks the methods are there."""

    def replace_engine(self, index: int) -> EngineAPI | None: ...

    def engine_ref(self, engine: Any) -> Any: ...


@runtime_checkable
class BuildsAhead(Protocol):
    """A service factory that can start building the engines before the trainer is built
    (`rollart/runner/dask_services.py`): the driver calls `begin` first, so their start-ups
    overlap. `isinstance` checks the method is there."""

    def begin(self) -> None: ...


if TYPE_CHECKING:  # the real classes conform: mypy checks these assignments
    from rollart.rollout.service import RolloutService
    from rollart.rollout.shards import ShardedRollout
    from rollart.services.engine import EngineService
    from rollart.services.trainer import TrainerService
    from rollart.services.trainer_group import TrainerGroup

    def _conforming(t: TrainerService, g: TrainerGroup, e: EngineService, r: RolloutService,
                    s: ShardedRollout) -> tuple[TrainerAPI, TrainerAPI, EngineAPI, RolloutAPI,
                                                RolloutAPI]:
        return t, g, e, r, s
