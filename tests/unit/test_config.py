import pytest

from rollart.config import ConfigError, load_config


def test_default_config_loads():
    cfg = load_config("configs/default.yaml")
    assert cfg.tasks[0].env_id == "FrozenLake-v1"
    assert cfg.model.tiny.hidden_size // cfg.model.tiny.num_heads >= 32


def test_overrides_parse_yaml_scalars():
    cfg = load_config("configs/default.yaml", ["train.lr=3e-4", "rollout.group_size=4",
                                               "engine.stop=[a,b]", "tasks.0.max_turns=3"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.rollout.group_size == 4
    assert cfg.engine.stop == ["a", "b"]
    assert cfg.tasks[0].max_turns == 3


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["train.lrr=1"], "unknown config key 'train.lrr'"),
        (["bogus=1"], "unknown config key 'bogus'"),
        (["rollout.group_size=abc"], "'rollout.group_size'"),
        (["rollout.group_size=1"], "group_size must be >= 2"),
        (["model.tiny.num_heads=4"], "head_dim"),
        (["cluster.stages.engine=TPU"], "no workers"),
        (["model.source=hf_dir"], "model.path is required"),
        (["algo.constrained_logprobs=vocab"], "set algo.off_policy: none"),
        (["engine.vllm.block_size=20"], "'engine.vllm.block_size'"),
    ],
)
def test_bad_config_names_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", overrides)
    msg = str(err.value)
    assert fragment in msg
    assert "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config("configs/default.yaml", ["train.lr"])


def test_uvloop_without_uvloop_names_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install uvloop.*rollout.event_loop=select"):
        load_config(None, ["rollout.runner=asyncio", "rollout.event_loop=uvloop"])
    # the default loop (select), and the threaded runner, need no uvloop
    assert load_config(None, ["rollout.runner=asyncio"]).rollout.event_loop == "select"
    assert load_config(None, ["rollout.runner=threads"])


@pytest.mark.parametrize("cuda", [False, True])
def test_vllm_block_size_of_48_needs_a_gpu(monkeypatch, cuda):
    """vLLM's CPU attention takes multiples of 32 only; a GPU takes any multiple of 16."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if cuda:
        assert load_config(None, ["engine.vllm.block_size=48"]).engine.vllm.block_size == 48
        return
    with pytest.raises(ConfigError, match="engine.vllm.block_size 48: .*multiple of 32"):
        load_config(None, ["engine.vllm.block_size=48"])
    assert load_config(None, ["engine.vllm.block_size=64"]).engine.vllm.block_size == 64
