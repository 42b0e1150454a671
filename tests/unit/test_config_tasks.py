"""`tasks:` checked at load (rollart/config/tasks.py): each problem is one line naming the key
(`tasks.<i>.env_id`, ...) and how to fix it, before any server, cluster or env starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollart.config import ConfigError, load_config
from rollart.config.tasks import BUILTIN_ENV_IDS

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "default.yaml"
TWO = ("tasks=[{name: guess, env_id: guess, env_kwargs: {}, max_turns: 6}, "
       "{name: calc, env_id: calculator, env_kwargs: {}, max_turns: 3}]")


def fails(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, list(overrides))
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_unknown_env_id_names_the_key_and_the_known_ids():
    msg = fails(TWO, "tasks.1.env_id=nope")
    assert msg.startswith("invalid config key 'tasks.1.env_id': unknown env id 'nope'"), msg
    assert "guess" in msg and "calculator" in msg and "FrozenLake-v1" in msg
    assert "register_env" in msg  # how to fix it


@pytest.mark.parametrize("env_id", ["guess", "calculator", "arith", "FrozenLake-v1",
                                    "FrozenLake8x8-v1", "Taxi-v4", "guess-wide"])
def test_known_env_ids_load(env_id):
    assert load_config(DEFAULT, [f"tasks.0.env_id={env_id}"]).tasks[0].env_id == env_id


def test_an_env_registered_in_the_process_counts():
    from rollart.envs import ENV_BUILDERS, register_env

    register_env("plugin-test/")(lambda task: None)
    try:
        assert load_config(DEFAULT, ["tasks.0.env_id=plugin-test/x"])
    finally:
        del ENV_BUILDERS["plugin-test/"]
    assert "'tasks.0.env_id'" in fails("tasks.0.env_id=plugin-test/x")


def test_builtin_ids_match_the_registry():
    """The config's list (data: importing the registry there would be an import cycle) is
    exactly what rollart.envs registers."""
    from rollart.envs import ENV_BUILDERS

    test_only = {k for k in ENV_BUILDERS if k.startswith(("test-", "plugin-test", "Crashy"))}
    registered = set(ENV_BUILDERS) - test_only
    assert set(BUILTIN_ENV_IDS) == registered, (
        f"rollart/config/tasks.py BUILTIN_ENV_IDS {sorted(BUILTIN_ENV_IDS)} must list exactly "
        f"the ids rollart.envs registers, {sorted(registered)}")


def test_unknown_env_id_from_the_cli_exits_2_with_one_line(tmp_path):
    """`rollart train --set tasks.0.env_id=nope`: refused before any server or cluster starts."""
    cli = Path(sys.executable).parent / "rollart"
    out = subprocess.run([str(cli), "train", "--set", "tasks.0.env_id=nope",
                          "--set", f"storage.root={tmp_path}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "'tasks.0.env_id'" in lines[0], out.stderr
    assert not any(tmp_path.iterdir())  # nothing written: no run started


@pytest.mark.parametrize("overrides, key", [
    (["tasks.0.share=0"], "tasks.0.share"),
    (["tasks.0.share=-1"], "tasks.0.share"),
    (["tasks.0.max_turns=0"], "tasks.0.max_turns"),
    ([TWO, "tasks.1.max_turns=-2"], "tasks.1.max_turns"),
])
def test_share_and_max_turns_name_the_key(overrides, key):
    assert f"'{key}'" in fails(*overrides)


def test_a_share_that_rounds_a_task_out_of_every_batch_is_refused():
    msg = fails(TWO, "tasks.1.share=0.1", "rollout.num_groups=4")
    assert msg.startswith("invalid config key 'tasks.1.share': task 'calc' (share 0.1)"), msg
    assert "raise its share or rollout.num_groups" in msg
    assert load_config(DEFAULT, [TWO, "tasks.1.share=0.1", "rollout.num_groups=8"])


def test_env_kwargs_are_the_env_builders_to_check():
    """The calculator takes no tool list: a `tools` entry is an unknown env_kwargs key, refused
    where the env is built (env code runs on env-class workers only, never at load)."""
    from rollart.envs import make_env

    cfg = load_config(DEFAULT, [TWO, "tasks.1.env_kwargs={tools: [calculate, search]}"])
    with pytest.raises(ValueError, match=r"calculator env_kwargs \['tools'\] unknown"):
        make_env(cfg.tasks[1])
