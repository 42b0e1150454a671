"""Secrets reach only the workers whose stages use them, never a worker's environment
(rollart/secrets.py).

The probe in issue 16: `client.run` on any worker found the S3 secret key (and the Lambda key
pair) in its environment, because every stack worker was started with them. The checkpoint key
(ROLLART_CHECKPOINT_KEY, which signs the run's checkpoints) goes the same way, to the trainer
and engine classes of every run. Here the real
local cluster (the embedded TLS HardwareClassCluster, and the stack's `dask scheduler` /
`dask worker` processes) is started from a process whose environment holds both key pairs, as
a user's shell or a run's blocks put them there; then each worker's environment is read, the
secrets each worker holds are listed per hardware class, the workers use them for real (a
SeaweedFS store, a SigV4 Invoke of the local Lambda endpoint), and every log, metric and
config dump we can reach is searched for the values.
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from pathlib import Path

import pytest
from distributed import Client

from infra.clusters import open_cluster
from infra.lambda_endpoint import LocalLambda
from infra.lambda_functions import FunctionSpec
from infra.seaweed import start_seaweed
from rollart import secrets
from rollart.config import dump_config, load_config
from rollart.config.hardware import worker_classes
from rollart.rewards.client import LambdaCredentials
from rollart.run import RunSpec

ROOT = Path(__file__).resolve().parents[2]
S3_KEY, S3_SECRET = "scopeS3key0001", "scope-s3-secret-Zq81xWv0pLm4"
LAM = LambdaCredentials("ROLLARTSCOPE0001", "scope-lambda-secret-Yt62kPp9")
CKPT_KEY = "5c09e7" * 10 + "a1b2"  # 64 hex digits
KEY_VAR = secrets.CHECKPOINT_KEY_VAR
VALUES = {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, **LAM.env(),
          KEY_VAR: CKPT_KEY}
SECRET_TEXTS = (S3_SECRET, LAM.secret_key, CKPT_KEY)  # what must never show up anywhere


def _environ() -> dict:
    """What `client.run` on a worker reads: os.environ, and the process's start-up environment
    (/proc/self/environ, which os.environ edits do not change)."""
    raw = Path("/proc/self/environ").read_bytes().decode(errors="replace")
    return {"os": dict(os.environ), "proc": raw}


def _store_round_trip(run: RunSpec, name: str) -> str:
    store = run.store()
    store.write_text(f"probe/{name}.txt", name)
    return store.read_text(f"probe/{name}.txt")


def _score(run: RunSpec, traj) -> float | str:
    from rollart.rewards.client import RewardError, make_reward_client

    try:
        make_reward_client(run.cfg.reward).score([traj])
    except RewardError as err:
        return f"RewardError: {err}"
    return traj.reward


def _no_secret_in(text: str, where: str) -> None:
    for s in SECRET_TEXTS:
        assert s not in text, f"a secret value appears in {where}"


@pytest.fixture
def services(tmp_path, monkeypatch):
    """SeaweedFS with S3_KEY/S3_SECRET, the local Lambda endpoint accepting only LAM; this
    process's environment holds both pairs (as a shell that exported them, or a run's blocks)."""
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(start_seaweed(tmp_path / "s3", access_key=S3_KEY,
                                               secret_key=S3_SECRET))
        lam = stack.enter_context(LocalLambda(
            [FunctionSpec("rollart-env-outcome", "env_outcome", 2, 30.0)], credentials=LAM,
            idle_timeout_s=30))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no IMDS probe when keyless
        for k, v in VALUES.items():
            monkeypatch.setenv(k, v)
        yield s3, lam
    secrets.release()


def _run_cfg(s3, lam, tmp_path, **over: str):
    overrides = [*s3.overrides("scope"), "reward.backend=lambda",
                 "reward.function_name=rollart-env-outcome", f"reward.endpoint_url={lam.url}",
                 "reward.max_retries=0", "reward.retry_timeout_s=5", "cluster.dashboard=false",
                 *[f"{k}={v}" for k, v in over.items()]]
    return load_config(ROOT / "configs/default.yaml", overrides)


def test_scope_follows_the_stage_map(tmp_path):
    """Hand-derived: the store's keys go to the classes of all four roles (and every engine
    pool), the Lambda pair to the env and reward classes only; a local store needs no keys;
    AWS Lambda signs with the AWS_* pair, so those go to the scorers even with a local store.
    The checkpoint key goes to the trainer and engine classes, always."""
    cfg = load_config(ROOT / "configs/default.yaml", [
        "storage.root=s3://bucket/p", "reward.backend=lambda", "reward.endpoint_url=http://127.0.0.1:9",
        "cluster.workers={H800: 1, H20: 1, CPU: 1, A10: 1}",
        "cluster.stages={trainer: H800, engine: H20, env: CPU, reward: A10}"])
    got = secrets.scope(cfg)
    assert got["AWS_SECRET_ACCESS_KEY"] == {"H800", "H20", "CPU", "A10"}
    assert got["ROLLART_LAMBDA_SECRET_ACCESS_KEY"] == {"CPU", "A10"}
    assert got[KEY_VAR] == {"H800", "H20"}
    key_only = {KEY_VAR: {"H800", "H20"}}  # the default config's trainer and engine classes
    local = load_config(ROOT / "configs/default.yaml", [f"storage.root={tmp_path}",
                                                        "reward.backend=local"])
    assert secrets.scope(local) == key_only
    embedded = load_config(ROOT / "configs/default.yaml", [f"storage.root={tmp_path}",
                                                           "reward.backend=lambda"])
    assert secrets.scope(embedded) == {**key_only, **{v: {"CPU"} for v in secrets.LAMBDA_VARS}}
    aws = load_config(ROOT / "configs/default.yaml", [
        f"storage.root={tmp_path}", "reward.backend=lambda", "reward.embedded_endpoint=false"])
    assert secrets.scope(aws) == {**key_only, **{v: {"CPU"} for v in secrets.STORAGE_VARS}}


def test_embedded_cluster_workers_hold_only_what_their_class_uses(services, tmp_path,
                                                                 make_traj, caplog):
    s3, lam = services
    cfg = _run_cfg(s3, lam, tmp_path)
    run = RunSpec(cfg, "scope")
    with contextlib.ExitStack() as stack:
        # what flows/train.py does for a run: secrets out of the environment, then the cluster
        moved = stack.enter_context(secrets.held_out_of_environment())
        assert set(moved) == set(VALUES) and not set(VALUES) & set(os.environ)
        cluster = stack.enter_context(open_cluster(cfg.cluster))
        assert cluster.address.startswith("tls://")
        client = stack.enter_context(Client(cluster.address))
        classes = {a: c for c, addrs in worker_classes(client).items() for a in addrs}
        assert sorted(classes.values()) == ["CPU", "H20", "H800"]
        by_class = {c: a for a, c in classes.items()}

        with secrets.on_cluster(client, cfg) as plugin:
            assert plugin is not None
            _no_secret_in(repr(plugin), "the plugin's repr")
            held = client.run(secrets.held_vars)
            envs = client.run(_environ)
            # Used for real: each class's stages can do their work with what they hold ...
            for c in ("H800", "H20", "CPU"):
                assert client.submit(_store_round_trip, run, c, workers=[by_class[c]],
                                     pure=False).result(timeout=120) == c
            traj = make_traj(1, success=True, task_return=1.0)
            traj.reward = None
            assert client.submit(_score, run, traj, workers=[by_class["CPU"]],
                                 pure=False).result(timeout=120) == 1.0
            # ... and a class that scores nothing cannot sign an Invoke.
            refused = client.submit(_score, run, traj, workers=[by_class["H800"]],
                                    pure=False).result(timeout=120)
            assert isinstance(refused, str) and "requires signed requests" in refused
            logs = repr(client.get_worker_logs()) + repr(client.get_scheduler_logs())
            info = repr(client.scheduler_info(n_workers=-1))
            configs = repr(client.run(lambda: __import__("dask").config.config))
            metrics = ""
            for w in client.scheduler_info(n_workers=-1)["workers"].values():
                url = f"http://127.0.0.1:{w['services']['dashboard']}/metrics"
                with urllib.request.urlopen(url, timeout=10) as r:
                    metrics += r.read().decode()
            assert "dask_worker" in metrics

        storage_vars = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert held[by_class["H800"]] == storage_vars | {KEY_VAR}
        assert held[by_class["H20"]] == storage_vars | {KEY_VAR}
        assert held[by_class["CPU"]] == storage_vars | set(LAM.env())
        for addr, env in envs.items():  # no worker has a secret in its environment at all
            assert not set(VALUES) & set(env["os"]), classes[addr]
            _no_secret_in(env["proc"], f"{classes[addr]}'s /proc/self/environ")
            _no_secret_in(repr(env["os"]), f"{classes[addr]}'s environment")
        for text, where in ((logs, "worker/scheduler logs"), (info, "scheduler_info"),
                            (configs, "the workers' Dask config"), (metrics, "/metrics"),
                            (dump_config(cfg), "the run config"), (caplog.text, "our log")):
            _no_secret_in(text, where)
        # The run is over: the plugin is gone, and with it every worker's secrets.
        assert all(not v for v in client.run(secrets.held_vars).values())
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == S3_SECRET  # this process's env is restored


def test_a_run_without_remote_secrets_gives_workers_only_the_checkpoint_key(services,
                                                                          tmp_path):
    """A local store and in-process rewards: the workers hold only the checkpoint key (the
    trainer and engine class: here the one CPU worker), in memory, and the user's exported
    keys do not reach the workers' environment."""
    cfg = load_config(ROOT / "configs/default.yaml", [f"storage.root={tmp_path}",
                                                      "reward.backend=local",
                                                      "cluster.workers={CPU: 1}",
                                                      "cluster.stages={trainer: CPU, engine: CPU,"
                                                      " env: CPU, reward: CPU}"])
    with contextlib.ExitStack() as stack:
        stack.enter_context(secrets.held_out_of_environment())
        cluster = stack.enter_context(open_cluster(cfg.cluster, dashboard=False))
        client = stack.enter_context(Client(cluster.address))
        with secrets.on_cluster(client, cfg) as plugin:
            assert plugin is not None
            assert all(v == {KEY_VAR} for v in client.run(secrets.held_vars).values())
            for env in client.run(_environ).values():
                assert not set(VALUES) & set(env["os"])
                _no_secret_in(env["proc"], "/proc/self/environ")


@pytest.fixture
def stack_dask(tmp_path):
    """The stack's scheduler and one worker per class, started by `Stack` as `rollart up`
    starts them, from an environment that holds both key pairs (a shell that exported them)."""
    from infra.prefect_server import free_port
    from infra.stack import Stack

    s = Stack(tmp_path / "state", classes={"H800": 1, "CPU": 1})
    s.state.mkdir(mode=0o700)
    s.ports.update(scheduler=free_port(), dashboard=free_port())
    env = {**{k: v for k, v in s.child_env().items() if k != "DASK_CONFIG"}, **VALUES}
    try:
        s._ensure_dask(env)
        yield s
    finally:
        s.down()


def _tree_environ(pid: int) -> list[bytes]:
    """/proc/<pid>/environ of `pid` and its descendants (a `dask worker` nanny's worker)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/{p}/environ").read_bytes())
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_stack_workers_start_without_secrets(stack_dask, tmp_path, services):
    from infra import dask_tls

    s = stack_dask
    s3, lam = services
    pids = [s._pid(n) for n in ("dask-scheduler", "dask-H800-0", "dask-CPU-0")]
    cfg = _run_cfg(s3, lam, tmp_path, **{"cluster.workers": "{H800: 1, CPU: 1}",
                                         "cluster.stages": "{trainer: H800, engine: H800, "
                                                           "env: CPU, reward: CPU}"})
    with contextlib.ExitStack() as stack:
        assert dask_tls.connect_existing(stack, s.scheduler_address, s.state)
        client = stack.enter_context(Client(s.scheduler_address, timeout=60))
        deadline = time.monotonic() + 120
        while len(client.scheduler_info()["workers"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        environs = [e for p in pids if p for e in _tree_environ(p)]
        assert len(environs) >= 5  # scheduler, two nannies, two worker processes
        for raw in environs:
            for name, value in VALUES.items():
                assert f"{name}=".encode() not in raw and value.encode() not in raw
        by_class = {c: a for c, addrs in worker_classes(client).items() for a in addrs}
        with secrets.held_out_of_environment(), secrets.on_cluster(client, cfg):
            held = client.run(secrets.held_vars)
        assert held[by_class["H800"]] == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", KEY_VAR}
        assert held[by_class["CPU"]] == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            *LAM.env()}
        assert all(not v for v in client.run(secrets.held_vars).values())
    for log in s.state.glob("*.log"):
        _no_secret_in(log.read_text(errors="replace"), log.name)
