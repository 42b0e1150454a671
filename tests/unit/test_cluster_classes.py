"""Default hardware classes: one home, copied (never shared) by everything that starts from it."""

from __future__ import annotations

import pytest

from rollart.config import ClusterConfig
from rollart.config.hardware import (
    DEFAULT_STAGES,
    DEFAULT_WORKERS,
    default_stages,
    default_workers,
)


def test_defaults_are_the_documented_classes():
    assert dict(DEFAULT_WORKERS) == {"H800": 1, "H20": 1, "CPU": 1}
    assert dict(DEFAULT_STAGES) == {"trainer": "H800", "engine": "H20", "env": "CPU",
                                    "reward": "CPU"}
    # every stage maps to a class that has a worker, else the default config would not load
    assert set(DEFAULT_STAGES.values()) <= set(DEFAULT_WORKERS)


def test_config_defaults_come_from_the_one_home_and_are_copies():
    a, b = ClusterConfig(), ClusterConfig()
    assert a.workers == default_workers() and a.stages == default_stages()
    a.workers["H200"] = 2
    a.stages["engine"] = "H200"
    assert b.workers == {"H800": 1, "H20": 1, "CPU": 1} and b.stages["engine"] == "H20"
    assert "H200" not in DEFAULT_WORKERS and DEFAULT_STAGES["engine"] == "H20"
    with pytest.raises(TypeError):
        DEFAULT_WORKERS["H200"] = 1  # type: ignore[index]


def test_configs_restate_no_default_hardware_classes_and_set_edits_one_entry():
    """The default classes have one home (rollart/config/hardware.py): no file in configs/
    restates them, and `--set cluster.workers.H800=2` on such a file edits one entry of the
    default map rather than replacing the map."""
    from pathlib import Path

    import yaml

    from rollart.config import load_config

    for path in sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")):
        cluster = (yaml.safe_load(path.read_text()) or {}).get("cluster") or {}
        assert cluster.get("workers") != default_workers(), path.name
        assert cluster.get("stages") != default_stages(), path.name
        cfg = load_config(path, ["cluster.workers.H800=2", "cluster.stages.env=H20"])
        assert cfg.cluster.workers == {**default_workers(), "H800": 2}, path.name
        assert cfg.cluster.stages == {**default_stages(), "env": "H20"}, path.name
