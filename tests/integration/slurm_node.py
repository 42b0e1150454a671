"""A real single-node Slurm for tests: munged + slurmctld + slurmd under a temp dir, started
and stopped by the caller (a pytest fixture), nothing left behind.

Recipe measured on these machines (DESIGN.md): Debian's slurm-wlm 22.05 + munge, no systemd
and no cgroups, so proctrack/linuxproc and task/none; the node is declared with more CPUs and
memory than the box has (`SlurmdParameters=config_overrides`) so several one-CPU worker jobs
run at once on 2 cores. Everything is private to this instance: its own munged socket (so a
munged someone else runs is neither used nor disturbed), its own ports, state and logs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
# Node features stand for GPU types: a class's `--constraint=h800` must reach a node that has it.
FEATURES = "h800,h20"


def ensure_installed() -> None:
    """Install slurm-wlm and munge with apt when missing (CI is root with the registry reachable;
    .ci/run does it too). Waits for another apt's dpkg lock instead of failing."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    if subprocess.run(["apt-get", *lock, "install", "-y", "-q", *PACKAGES], env=env,
                      capture_output=True).returncode != 0:
        subprocess.run(["apt-get", *lock, "update", "-q"], env=env, check=True,
                       capture_output=True)
        subprocess.run(["apt-get", *lock, "install", "-y", "-q", *PACKAGES], env=env,
                       check=True, capture_output=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmNode:
    """`start()` brings the daemons up and returns the environment (SLURM_CONF) under which
    sbatch/squeue/scancel talk to this instance; `stop()` cancels every job and ends them."""

    def __init__(self, cpus: int = 8, memory_mb: int = 20000) -> None:
        self.cpus, self.memory_mb = cpus, memory_mb
        self.dir = Path(tempfile.mkdtemp(prefix="rollart-slurm-"))
        self.procs: list[subprocess.Popen] = []
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _write(self) -> None:
        d = self.dir
        self.dir.chmod(0o755)  # munged runs as user munge and must reach its directory
        munge_dir = d / "munge"
        munge_dir.mkdir()
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o755)  # munged: clients need search permission on the socket dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        self.socket = munge_dir / "munge.socket"
        self.conf.write_text("\n".join([
            "ClusterName=rollart-test",
            f"SlurmctldHost={self.host}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}",
            "CredType=cred/munge",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SlurmdParameters=config_overrides",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            f"NodeName={self.host} CPUs={self.cpus} RealMemory={self.memory_mb} "
            f"Features={FEATURES} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def start(self, timeout: float = 60.0) -> dict[str, str]:
        ensure_installed()
        self._write()
        log = open(self.dir / "log" / "daemons.out", "ab")
        munged = ["runuser", "-u", "munge", "--", "munged", "-F", f"--socket={self.socket}",
                  f"--pid-file={self.dir / 'munge' / 'munged.pid'}",
                  f"--log-file={self.dir / 'munge' / 'munged.log'}",
                  f"--seed-file={self.dir / 'munge' / 'munged.seed'}"]
        env = {**os.environ, **self.env}
        # Own process groups: stop() ends each daemon and whatever it spawned (job steps).
        self.procs.append(subprocess.Popen(munged, stdout=log, stderr=log,
                                           start_new_session=True))
        self._wait(lambda: self.socket.exists(), timeout, "munged socket")
        for cmd in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=env,
                                               start_new_session=True))
        self._wait(self._node_idle, timeout, "node idle in sinfo")
        return self.env

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                             env={**os.environ, **self.env})
        return out.returncode == 0 and out.stdout.strip().startswith("idle")

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        raise RuntimeError(f"single-node Slurm: no {what} within {timeout:.0f} s; logs: "
                           f"{self.logs()[-2000:]}")

    def logs(self) -> str:
        files = sorted(self.dir.rglob("*.log")) + [self.dir / "log" / "daemons.out"]
        return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())

    def jobs(self) -> list[dict[str, str]]:
        """Every job this instance knows (running, pending, or just ended)."""
        out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%f|%b|%C|%r"], capture_output=True,
                             text=True, env={**os.environ, **self.env}, check=True).stdout
        keys = ("id", "name", "state", "features", "gres", "cpus", "reason")
        return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines()]

    def stop(self) -> None:
        env = {**os.environ, **self.env}
        subprocess.run(["scancel", "--user=root", "--full"], env=env, capture_output=True,
                       timeout=30)
        time.sleep(0.5)  # slurmd signals the job steps before it goes
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self._kill_leftover_jobs()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_leftover_jobs(self) -> None:
        # linuxproc tracks a job's processes by parentage; a worker that daemonised would outlive
        # slurmd. Our jobs' processes carry SLURM_CONF=<our conf> and a SLURM_JOB_ID.
        marker = f"SLURM_CONF={self.conf}".encode()
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                env = (pid_dir / "environ").read_bytes().split(b"\0")
                if marker in env and any(e.startswith(b"SLURM_JOB_ID=") for e in env):
                    os.kill(int(pid_dir.name), signal.SIGKILL)
            except (OSError, ValueError):
                continue

