"""Test hosts on one machine: Linux network namespaces joined by a bridge (needs root).

Each host is a namespace with its own veth link and address on a private /24; the creating
(root) namespace holds the bridge and its .1 address, so the test process reaches every host and
the hosts reach each other, and nothing else sees the traffic. Processes started on a host
(`popen`) run in its namespace only (same filesystem: the checkout is at the same path, which is
what Dask workers need). `remove(host)` takes a host off the network and kills everything on it,
as a machine failure would; `close()` removes every namespace, link and the bridge, also after
a failure.

    with NetnsHosts(["sched", "store", "gpu", "env"]) as hosts:
        hosts.popen("sched", [python, "-m", "distributed.cli.dask_scheduler", "--host",
                              hosts.addr("sched")])
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str
    netns: str
    addr: str
    veth: str  # our end, on the bridge
    procs: list[subprocess.Popen] = field(default_factory=list)


class NetnsHosts:
    def __init__(self, names: list[str], tag: str | None = None) -> None:
        # Interface names are at most 15 characters; the pid keeps concurrent runs apart.
        pid = os.getpid()
        self.tag = tag or f"r{pid % 100000}x"
        self.subnet = f"10.217.{pid % 250 + 1}"
        self.bridge = f"{self.tag}br"
        self.hosts = {n: Host(n, f"{self.tag}-{n}", f"{self.subnet}.{i + 2}", f"{self.tag}v{i}")
                      for i, n in enumerate(names)}
        self._made: list[tuple[str, str]] = []  # what exists, to remove

    def __enter__(self) -> NetnsHosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts.values():
            _ip("netns", "add", h.netns)
            self._made.append(("netns", h.netns))
            inner = f"{h.veth}p"
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", inner)
            self._made.append(("link", h.veth))
            _ip("link", "set", inner, "netns", h.netns)
            _ip("link", "set", h.veth, "master", self.bridge, "up")
            for cmd in (["addr", "add", f"{h.addr}/24", "dev", inner],
                        ["link", "set", inner, "up"], ["link", "set", "lo", "up"]):
                _ip("netns", "exec", h.netns, "ip", *cmd)

    def addr(self, host: str) -> str:
        return self.hosts[host].addr

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on `host` (its own process group; env/cwd/stdout as for Popen)."""
        h = self.hosts[host]
        proc = subprocess.Popen(["ip", "netns", "exec", h.netns, *argv],
                                start_new_session=True, stdin=subprocess.DEVNULL, **kwargs)
        h.procs.append(proc)
        return proc

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.hosts[host].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def remove(self, host: str) -> None:
        """The host drops off the network first (no FIN or RST reaches anyone, as when a machine
        dies), then everything on it is killed."""
        h = self.hosts[host]
        _ip("link", "set", h.veth, "down", check=False)
        self._kill(h)

    def _kill(self, h: Host) -> None:
        for _ in range(3):  # processes may fork while we kill; a few rounds
            pids = self.pids(h.name)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for p in h.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    def close(self) -> None:
        for h in self.hosts.values():
            if ("netns", h.netns) in self._made:
                self._kill(h)
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made.clear()

    def leftovers(self) -> list[str]:
        """Namespaces or links of ours that still exist (for tests of the cleanup)."""
        links = _ip("-br", "link", check=False).stdout.split()
        spaces = _ip("netns", "list", check=False).stdout.split()
        return sorted({x.split("@")[0] for x in links + spaces if x.startswith(self.tag)})
