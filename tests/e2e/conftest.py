"""One real local stack for the whole e2e session: `rollart up` on free loopback ports in a
temporary state directory, `rollart deploy` with tiny training overrides baked into the train
deployment, `rollart down` at the end (and a check that every process it started is gone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["iterations=2", "rollout.num_groups=2", "rollout.group_size=4", "tasks.0.max_turns=3",
        "eval.episodes=4", "storage.save_every=2"]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts the whole local stack (rollart up)")


class StackHandle:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(ROLLART_STATE_DIR=str(state), PYTHONUNBUFFERED="1")
        self.info: dict[str, Any] = {}
        self.up_output = self.deploy_output = ""
        self.up_seconds = 0.0

    def cli(self, *args: str, timeout: float = 300, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        """`rollart <args>` (the stack commands), as a user would run it."""
        proc = subprocess.run([sys.executable, "-m", "cli.stack", *args], cwd=ROOT,
                              env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"rollart {' '.join(args)} -> {proc.returncode}\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def prefect(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The real `prefect` CLI against the stack's server."""
        env = {**self.env, "PREFECT_API_URL": self.api_url, "PREFECT_API_AUTH_STRING": self.auth}
        return subprocess.run([str(Path(sys.executable).with_name("prefect")), *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)

    @property
    def api_url(self) -> str:
        return self.info["api_url"]

    @property
    def auth(self) -> str:
        """The stack's Prefect basic auth (`user:password`): every API call needs it."""
        return (self.state / "prefect-auth").read_text().strip()

    @property
    def ui_url(self) -> str:
        return self.info["ui_url"]

    @contextmanager
    def client(self) -> Iterator[Any]:
        from prefect import get_client
        from prefect.settings import (
            PREFECT_API_AUTH_STRING,
            PREFECT_API_URL,
            temporary_settings,
        )

        with temporary_settings({PREFECT_API_URL: self.api_url,
                                 PREFECT_API_AUTH_STRING: self.auth}):
            with get_client(sync_client=True) as c:
                yield c

    def wait_final(self, flow_run_id: Any, timeout: float = 300) -> Any:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                fr = c.read_flow_run(flow_run_id)
                if fr.state and fr.state.type.value in FINAL:
                    return fr
                if time.monotonic() > deadline:
                    raise AssertionError(f"flow run {flow_run_id} still {fr.state} after "
                                         f"{timeout:.0f}s (logs in {self.state})")
                time.sleep(1.0)

    def pids(self) -> list[int]:
        out = []
        for f in self.state.glob("*.pid"):
            try:
                out.append(int(f.read_text()))
            except ValueError:
                pass
        return out

    def secret(self) -> str | None:
        """The local S3 secret key (to check that it never shows up anywhere)."""
        f = self.state / "seaweed" / "seaweed.json"
        return json.loads(f.read_text())["secret_key"] if f.exists() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackHandle]:
    h = StackHandle(tmp_path_factory.mktemp("rollart-stack"))
    pids: list[int] = []
    try:
        t0 = time.monotonic()
        up = h.cli("up", "--free-ports", "--poll-seconds", "2", timeout=180)
        h.up_output, h.up_seconds = up.stdout, time.monotonic() - t0
        pids = h.pids()
        h.info = json.loads(h.cli("status", "--json").stdout)
        sets = [a for o in TINY for a in ("--set", o)]
        h.deploy_output = h.cli("deploy", *sets, timeout=180).stdout
        yield h
    finally:
        pids = sorted(set(pids + h.pids()))
        h.cli("down", check=False, timeout=120)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        assert not left, f"processes still running after `rollart down`: {left}"
