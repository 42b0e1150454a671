"""The chaos benchmark's injector (benchmarks/chaos.py): the fault schedule and the thread that
carries it out while the flow runs, recording what it did and when."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

from benchmarks.chaos_figures import Rows
from benchmarks.chaos_services import Endpoint, Watch, holders, kill_worker, worker_pid

LATE = ("rollout", "crash", "hang", "engine", "env")  # --after-greedy: after the first success
SCHEDULE = {"lambda": 0.05, "s3": 0.12, "trainer": 0.25, "rollout": 0.40, "crash": 0.50,
            "hang": 0.60, "engine": 0.72, "env": 0.85}


def rollout_generation(key: str, run_id: str) -> tuple[int, int]:
    """`rollout-<run>-<attempt>[-g<n>]` -> (attempt, n): the newest rollout service sorts last
    (a restart from the checkpoint bumps the attempt, a live rebuild the generation)."""
    parts = key.removeprefix(f"rollout-{run_id}-").split("-")
    gen = next((int(p[1:]) for p in parts[1:] if p.startswith("g") and p[1:].isdigit()), 1)
    return int(parts[0]), gen


class Chaos:
    """Injects the schedule from a thread while the flow runs; records what it did."""

    def __init__(self, run_id: str, client: Any, store: Any, rows: Rows, s3: Any,
                 s3_watch: Watch, endpoint: Endpoint, lambda_watch: Watch,
                 scenario: str = "services", iterations: int = 40,
                 after_greedy: bool = False) -> None:
        self.run_id, self.client, self.store, self.rows = run_id, client, store, rows
        self.scenario = scenario
        self.s3, self.s3_watch, self.endpoint, self.lambda_watch = s3, s3_watch, endpoint, \
            lambda_watch
        self.iterations = iterations
        self.after_greedy = after_greedy
        self.due: dict[str, int] = {}
        self.faults: list[dict[str, Any]] = []
        self.error: str | None = None
        self.stopped: int | None = None  # pid under SIGSTOP

    def wait(self, ready: Any, timeout: float = 1500) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.rows.done.is_set():
                raise RuntimeError("the run ended before the fault was due")
            if time.monotonic() > deadline:
                raise TimeoutError("the fault's moment never came")
            time.sleep(0.5)

    def checkpoint(self, step: int) -> bool:
        try:
            self.store.fs.invalidate_cache()
            return step in self.store.list_checkpoints()
        except Exception:
            return False

    def checkpoint_from(self, step: int) -> bool:
        """A checkpoint at or past `step` exists (a kill then costs at most the iterations
        since it)."""
        try:
            self.store.fs.invalidate_cache()
            return max(self.store.list_checkpoints(), default=-1) >= step
        except Exception:
            return False

    def engines(self) -> dict[int, str]:
        """Replica index -> worker, for the current attempt's engines."""
        out: dict[int, tuple[int, str]] = {}
        for worker, keys in holders(self.client, f"engine-{self.run_id}-").items():
            for k in keys:
                attempt, index = k.removeprefix(f"engine-{self.run_id}-").split("-")[:2]
                if int(attempt) >= out.get(int(index), (-1, ""))[0]:
                    out[int(index)] = (int(attempt), worker)
        return {i: w for i, (_, w) in out.items()}

    def lost_engines(self, skip: str | None = None) -> list[int]:
        """The rollout service's lost replicas, asked on its worker."""
        try:  # a worker may be going away while we ask: ask again next time
            for worker, keys in holders(self.client, "rollout-", skip=skip).items():
                key = max(keys, key=lambda k: rollout_generation(k, self.run_id))
                return list(self.client.run(
                    lambda dask_worker, k=key: dask_worker.state.actors[k].lost_engines(),
                    workers=[worker])[worker])
        except Exception:
            pass
        return []

    def record(self, kind: str, t0: float, **extra: Any) -> dict[str, Any]:
        f = {"kind": kind, "injected_at": t0, "reached": self.rows.reached(t0), **extra}
        self.faults.append(f)
        return f

    def restart(self, kind: str, stop: Any, start: Any, watch: Watch) -> None:
        """Down until a call of the run found it down (3-20 s), then started again."""
        t0 = time.time()
        stop()
        time.sleep(3)
        deadline = time.monotonic() + 17
        while watch.first(t0, False) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        t_up = time.time()
        start()
        self.record(kind, t0, down_s=round(t_up - t0, 1), restarted_at=time.time(), watch=watch)

    def kill(self, kind: str, worker: str, **extra: Any) -> None:
        t0 = time.time()
        pid = kill_worker(self.client, worker)
        self.record(kind, t0, worker=worker, pid=pid, **extra)

    def run(self) -> None:
        try:
            self._run()
        except Exception as err:  # reported in the result, never silently
            self.error = f"{type(err).__name__}: {err}"
        finally:
            if self.stopped is not None:
                with contextlib.suppress(ProcessLookupError):  # its cluster may be gone
                    os.kill(self.stopped, signal.SIGCONT)

    def _run(self) -> None:
        rows = self.rows
        if self.scenario == "trainer_rank":
            self.wait(lambda: rows.reached() >= 2 and self.checkpoint(2))
            rank1 = [w for w, keys in holders(self.client, f"trainer-{self.run_id}-").items()
                     if any(k.endswith("-r1") for k in keys)]
            self.kill("trainer_rank_kill", rank1[0], rank=1)
            return
        due = self.due = {k: max(0, round(f * self.iterations) - 1) for k, f in SCHEDULE.items()}
        self.wait(lambda: rows.reached() >= due["lambda"])
        self.restart("lambda_restart", self.endpoint.stop, self.endpoint.start,
                     self.lambda_watch)
        self.wait(lambda: rows.reached() >= due["s3"])
        self.restart("s3_restart", self.s3.stop, self.s3.start, self.s3_watch)
        self.wait(lambda: rows.reached() >= due["trainer"]
                  and self.checkpoint_from(round(0.2 * self.iterations)))
        self.kill("trainer_kill", next(iter(holders(self.client, "trainer-"))))
        t = self.faults[-1]["injected_at"]
        self.wait(lambda: rows.past(t) is not None and self.due_now("rollout")
                  and (self.after_greedy or self.checkpoint_from(round(0.35 * self.iterations))))
        self.kill("rollout_service_kill", next(iter(holders(self.client, "rollout-"))))
        t = self.faults[-1]["injected_at"]
        self.wait(lambda: rows.past(t) is not None and self.due_now("crash"))
        self.crash_rollout()
        t = self.faults[-1]["injected_at"]
        self.wait(lambda: rows.past(t) is not None and self.due_now("hang"))
        worker = self.engines()[1]
        pid = worker_pid(self.client, worker)
        t0 = time.time()
        os.kill(pid, signal.SIGSTOP)
        self.stopped = pid
        hang = self.record("engine_hang", t0, worker=worker, pid=pid, replica=1)
        # Stopped until the run has marked it lost (a call past its deadline), at most 3 min.
        t_w = time.monotonic()
        while (1 not in self.lost_engines(skip=worker) and time.monotonic() - t_w < 180
               and not rows.done.is_set()):
            time.sleep(1)
        os.kill(pid, signal.SIGCONT)
        self.stopped = None
        hang["stopped_s"] = round(time.time() - t0, 1)
        t_w = time.monotonic()  # probed back into rotation (or 3 min), and a row
        self.wait(lambda: (1 not in self.lost_engines() or time.monotonic() - t_w > 180)
                  and rows.after(t0 + hang["stopped_s"]) >= 1 and self.due_now("engine"))
        self.kill("engine_kill", self.engines()[0], replica=0)
        t = self.faults[-1]["injected_at"]
        self.wait(lambda: rows.after(t) >= 1 and self.due_now("env"))
        rollout = set(holders(self.client, "rollout-"))
        env = [w for w in holders(self.client, "env-host-") if w not in rollout]
        self.kill("env_host_kill", env[0])

    def due_now(self, kind: str) -> bool:
        """Whether fault `kind` is due: at its fraction of the run; with `--after-greedy` a late
        fault instead waits for the run's own first successful greedy evaluation (then one
        every 2 iterations), or for the last iterations that still leave room for the rest."""
        reached = self.rows.reached()
        if not self.after_greedy or kind not in LATE:
            return reached >= self.due[kind]
        k = LATE.index(kind)
        last_chance = self.iterations - 3 * (len(LATE) - k) - 1
        first = self.rows.first_greedy
        return reached >= (last_chance if first is None else min(first + 1 + 2 * k,
                                                                 last_chance))

    def crash_rollout(self) -> None:
        """End the rollout service's own threads on its (living) worker."""
        [(worker, _)] = list(holders(self.client, "rollout-").items())
        t0 = time.time()
        def end_rollout_threads() -> list[str]:
            """On the rollout service's worker: raise SystemExit in each of the service's own
            threads (batchers, watchdog, or the asyncio runner's loop), so they end as an
            uncaught error would; the worker process and the service's state live on. Nested:
            client.run ships it by value (a worker need not import benchmarks/)."""
            import ctypes

            names = ("rollout-batcher", "rollout-watch", "rollout-loop")
            ended = []
            for t in threading.enumerate():
                if t.name in names and t.ident is not None and t.is_alive():
                    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(t.ident), ctypes.py_object(SystemExit))
                    if n == 1:
                        ended.append(t.name)
            return ended

        ended = self.client.run(end_rollout_threads, workers=[worker])[worker]
        self.record("rollout_service_crash", t0, worker=worker, threads=ended)
