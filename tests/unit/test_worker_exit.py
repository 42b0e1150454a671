"""An embedded cluster's worker process, once its worker closed cleanly, runs every cleanup a
normal exit runs (atexit handlers, weakref finalizers), each once, and then leaves without the
interpreter's teardown of every module (infra/dask_cluster.QuickExitWorker)."""

from __future__ import annotations

from pathlib import Path

from distributed import Client

from infra.dask_cluster import HardwareClassCluster


def _plant(log: str) -> None:
    """In the worker process: an atexit handler, a finalizer of an object alive until exit, and
    an object whose __del__ only the interpreter's teardown of the modules runs (it writes
    through a descriptor opened now: `open` is gone by then); each notes itself in `log`."""
    import atexit
    import os
    import sys
    import types
    import weakref

    def note(what: str) -> None:
        with open(log, "a") as fh:
            fh.write(what + "\n")

    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    class Held:
        def __del__(self, write=os.write, fd=fd) -> None:
            write(fd, b"teardown\n")

    module = types.ModuleType("rollart_exit_probe")
    module.held = Held()  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    weakref.finalize(module.held, note, "finalizer")  # type: ignore[attr-defined]
    atexit.register(note, "atexit")


def test_a_closed_worker_runs_every_exit_cleanup_once_and_skips_the_teardown(tmp_path: Path):
    log = tmp_path / "exit.log"
    with HardwareClassCluster(workers={"CPU": 1}, dashboard=False) as cluster, \
            Client(cluster) as client:
        client.run(_plant, str(log))
    # The cluster waited for the process to exit: its notes are all written.
    assert log.read_text().splitlines() == ["atexit", "finalizer"]
