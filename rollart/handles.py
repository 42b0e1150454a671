"""Service handles: a long-lived service is a Dask actor in a run and a plain object in tests,
benchmarks and the in-process mode. These helpers hide the difference.

Every actor call has a deadline (`cluster.call_timeout_s`): a hung or lost worker must fail
the call with an error that names the service and method, not hang the run. `set_call_timeout`
installs the run's value in a process (the driver and each service do it); a process that
never heard of the run keeps the config's default. Plain objects are called directly, in the
caller's thread: nothing crosses a worker, so there is nothing to time out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

DEFAULT_CALL_TIMEOUT_S = 600.0  # = ClusterConfig.call_timeout_s's default
PRESENCE_POLL_S = 5.0  # a waiting call asks whether its service's worker is still there
# `call(..., while_alive=True)`: past its deadline, a call whose worker still sends heartbeats
# (the scheduler's `last_seen` advanced within HEARTBEAT_WINDOW_S) is busy, not hung or lost,
# and is waited on up to BUSY_FACTOR x its deadline in all; a stopped or hung process sends none.
BUSY_FACTOR = 4.0
HEARTBEAT_WINDOW_S = 10.0
ALIVE_POLL_S = 2.0
_call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S
Deadline = float | None | Literal["default"]  # a call's `timeout`: "default" is the process's
T = TypeVar("T")


class CallTimeoutError(TimeoutError):
    """An actor call ran past its deadline; the message names the service and the method."""


def set_call_timeout(seconds: float | None) -> None:
    """This process's deadline for actor calls (None: no deadline)."""
    global _call_timeout_s
    _call_timeout_s = seconds


def call_timeout() -> float | None:
    return _call_timeout_s


def service_name(handle: Any) -> str:
    """The class behind a handle (a Dask actor's `_cls`, or the object's own type)."""
    return getattr(getattr(handle, "_cls", None), "__name__", None) or type(handle).__name__


class _Calls:
    """What `call(handle)` returns: `.method(*args)` calls `handle.method` through `invoke`
    (the deadline and errors of `call`), and returns the method's answer. Typed as the handle's
    own type, so a type checker verifies the method and its arguments (see `call`)."""

    __slots__ = ("_handle", "_invoke")

    def __init__(self, handle: Any, invoke: Callable[..., Any]) -> None:
        self._handle, self._invoke = handle, invoke

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):  # copy, pickle and the like: not a service method
            raise AttributeError(method)
        invoke, handle = self._invoke, self._handle

        def bound(*args: Any, **kwargs: Any) -> Any:
            return invoke(handle, method, args, kwargs)

        bound.__name__ = bound.__qualname__ = method
        return bound

    def __repr__(self) -> str:
        return f"call({service_name(self._handle)})"


@overload
def call(handle: T, *, timeout: Deadline = "default", while_alive: bool = False) -> T: ...


@overload
def call(handle: Any, method: str, *args: Any, timeout: Deadline = "default",
         while_alive: bool = False) -> Any: ...


def call(handle: Any, method: str | None = None, *args: Any, timeout: Deadline = "default",
         while_alive: bool = False) -> Any:
    """A Dask actor call (returns a future) or a plain method call, uniformly.

    Typed form: `call(handle, timeout=..., while_alive=...).method(*args)`, one call of
    `handle.method`. `call(handle)` is typed as `handle`'s own type (a Protocol of
    `rollart.service_protocols` for a service), so a type checker verifies the method's name,
    its arguments and its answer's use; at run time it is a small proxy whose methods make
    the call below. The untyped form `call(handle, "method", *args)` does the same.

    `timeout`: seconds, None for no deadline (a call that waits for data by design), or the
    process's deadline (`set_call_timeout`) by default. A call with a deadline also ends early,
    with `ServiceLostError`, once the service's worker has left the cluster (checked every
    `PRESENCE_POLL_S` of waiting): a dead worker's call otherwise lasts the whole deadline.
    `while_alive`: for a call whose duration grows with the work (a policy update), the
    deadline is one of liveness: past it the call goes on while its worker still sends
    heartbeats (slow, not lost), up to `BUSY_FACTOR` x the deadline; a worker that sent none
    within `HEARTBEAT_WINDOW_S` (stopped, hung) fails it at the deadline as before."""
    if method is None:
        return _Calls(handle, lambda h, m, a, kw: _call(h, m, a, kw, timeout, while_alive))
    return _call(handle, method, args, {}, timeout, while_alive)


def _call(handle: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
          timeout: Deadline, while_alive: bool) -> Any:
    out = getattr(handle, method)(*args, **kwargs)
    if not (hasattr(out, "result") and callable(out.result)):
        return out
    limit = _call_timeout_s if timeout == "default" else timeout
    if limit is None:
        return out.result()
    t0 = time.monotonic()
    end = t0 + limit
    beats = _Heartbeats(handle)
    while True:
        now = time.monotonic()
        wait = min(PRESENCE_POLL_S, end - now) if now < end else ALIVE_POLL_S
        try:
            return out.result(timeout=max(wait, 0.0))
        except TimeoutError as err:
            present = beats.read()
            if not present:
                raise ServiceLostError(
                    f"{service_name(handle)}.{method}: its worker {handle._address} left the "
                    "cluster while the call waited") from None
            now = time.monotonic()
            if now < end:
                continue
            if not while_alive:
                raise CallTimeoutError(
                    f"{service_name(handle)}.{method} did not answer within {limit:g}s "
                    "(cluster.call_timeout_s): its worker is hung, overloaded or lost") from err
            alive = beats.alive(now)
            if alive is None or (alive and now - t0 < BUSY_FACTOR * limit):
                continue  # not known yet, or busy: its worker is there and beating
            raise CallTimeoutError(
                f"{service_name(handle)}.{method} did not answer within {now - t0:.0f}s "
                f"(cluster.call_timeout_s={limit:g}, "
                + ("its worker still alive: busy past "
                   f"{BUSY_FACTOR:g}x the deadline" if alive else
                   f"no heartbeat from its worker for {HEARTBEAT_WINDOW_S:g}s")
                + "): its worker is hung, overloaded or lost") from err


class _Heartbeats:
    """The scheduler's `last_seen` of the worker holding an actor, read when a call has waited:
    whether that worker is still in the cluster, and whether its heartbeats still arrive."""

    def __init__(self, handle: Any) -> None:
        self.address = getattr(handle, "_address", None)
        self.first: float | None = None  # when (monotonic) the first reading was taken
        self.seen: float | None = None  # the last reading's last_seen
        self.changed: float | None = None  # when a reading last differed from the one before

    def read(self) -> bool:
        """Whether the worker is (as far as the scheduler can tell) still there."""
        if self.address is None:
            return True
        workers = _scheduler_workers()
        if workers is None or not workers:  # no answer, or no worker listed: not an absence
            return True
        info = workers.get(self.address)
        if info is None:
            return False
        now, seen = time.monotonic(), info.get("last_seen")
        if self.first is None:
            self.first = now
        elif seen != self.seen:
            self.changed = now
        self.seen = seen
        return True

    def alive(self, now: float) -> bool | None:
        """Heartbeats arrived within the window (True), none for the whole window (False),
        or too few readings yet to tell (None)."""
        if self.address is None:
            return True
        if self.changed is not None and now - self.changed <= HEARTBEAT_WINDOW_S:
            return True
        if self.first is None or now - self.first < HEARTBEAT_WINDOW_S:
            return None
        return False


class ServiceLostError(OSError):
    """The worker holding a service left the cluster while a call to it was waiting (an
    `OSError`, like a closed connection: the caller treats it as a lost service)."""


def _scheduler_workers() -> dict[str, Any] | None:
    """The scheduler's workers (address -> identity), or None when it cannot be asked."""
    try:
        from distributed import get_client

        # Asked of the scheduler each time: `Client.scheduler_info()` may answer from a cache
        # (empty, or stale) without saying so.
        client = get_client()
        return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    except Exception:
        return None


def _worker_present(handle: Any) -> bool:
    """Whether the scheduler still lists the worker holding actor `handle` (True for plain
    objects, or when the scheduler cannot be asked: only a sure absence counts)."""
    address = getattr(handle, "_address", None)
    if address is None:
        return True
    workers = _scheduler_workers()
    return not workers or address in workers  # no worker listed at all: not an answer


@overload
def call_while_present(handle: T, *, poll_s: float = 5.0) -> T: ...


@overload
def call_while_present(handle: Any, method: str, *args: Any, poll_s: float = 5.0) -> Any: ...


def call_while_present(handle: Any, method: str | None = None, *args: Any,
                       poll_s: float = 5.0) -> Any:
    """A call with no deadline (it waits for data by design, e.g. a batch of rollouts) that
    still fails, with `ServiceLostError`, once the service's worker has left the cluster: a
    call to a dead worker's actor otherwise waits for ever (Dask waits for the actor to be
    re-created, and an actor pinned to its worker never is). Typed form, as `call`'s:
    `call_while_present(handle, poll_s=...).method(*args)`."""
    if method is None:
        return _Calls(handle, lambda h, m, a, kw: _call_while_present(h, m, a, kw, poll_s))
    return _call_while_present(handle, method, args, {}, poll_s)


def _call_while_present(handle: Any, method: str, args: tuple[Any, ...],
                        kwargs: dict[str, Any], poll_s: float) -> Any:
    out = getattr(handle, method)(*args, **kwargs)
    if not (hasattr(out, "result") and callable(out.result)):
        return out
    while True:
        try:
            return out.result(timeout=poll_s)
        except TimeoutError:
            if not _worker_present(handle):
                raise ServiceLostError(
                    f"{service_name(handle)}.{method}: its worker {handle._address} left the "
                    "cluster while the call waited") from None


@dataclass(frozen=True)
class ActorRef:
    """A Dask actor handle by class, worker address and key, without the actor's task as a
    dependency: a Dask task whose arguments hold an `Actor` depends on the actor's key, so the
    loss of that actor's worker cancels the task ("Worker holding Actor was lost") even when the
    task could go on without it (a sync that skips a lost engine replica)."""

    cls: type
    address: str
    key: str


def _has_handles(value: Any) -> bool:
    """An object that holds service handles and maps them (`map_handles`). Asked of its type: a
    Dask Actor answers any attribute with a remote method, and one whose worker was lost raises
    on every attribute."""
    return callable(getattr(type(value), "map_handles", None))


def detach(value: Any) -> Any:
    """`value` with every Actor (also inside lists and tuples) replaced by its ActorRef."""
    if isinstance(value, (list, tuple)):
        return type(value)(detach(v) for v in value)
    if _has_handles(value):  # a handle of handles (rollart.rollout.shards.ShardedRollout)
        return value.map_handles(detach)
    cls = getattr(value, "_cls", None)
    if cls is not None and hasattr(value, "_address") and hasattr(value, "key"):
        return ActorRef(cls, value._address, value.key)
    return value


def attach(value: Any) -> Any:
    """The inverse of `detach`, where the value is used (on a worker)."""
    if isinstance(value, (list, tuple)):
        return type(value)(attach(v) for v in value)
    if _has_handles(value):
        return value.map_handles(attach)
    if isinstance(value, ActorRef):
        from distributed.actor import Actor

        return Actor(value.cls, value.address, value.key)
    return value


def release(handle: Any) -> None:
    """Let Dask forget an actor this process created (best effort; plain objects: nothing).
    While a client holds an actor's future, the scheduler re-runs the actor's creation on
    another worker when the actor's worker dies: a second, unused service. A lost service
    that has been replaced, or the old services of a restarted run, are released instead."""
    if _has_handles(handle):
        handle.map_handles(release)
        return
    fut = getattr(handle, "_future", None)
    if fut is not None and callable(getattr(fut, "release", None)):
        try:
            fut.release()
        except Exception:  # its client may be closing: nothing left to release
            pass


def worker_identity() -> dict[str, Any]:
    """Name and resources of the Dask worker running the caller (empty outside a worker)."""
    try:
        from distributed import get_worker

        w = get_worker()
        return {"worker": w.name, "address": w.address, "resources": dict(w.state.total_resources)}
    except (ImportError, ValueError):
        return {"worker": None, "address": None, "resources": {}}
