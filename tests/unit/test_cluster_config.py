"""`cluster.manager` and its sections: validated at load, one line saying how to fix it."""

import pytest

from rollart.config import ConfigError, load_config


def test_manager_is_inferred_for_older_configs():
    assert load_config("configs/default.yaml").cluster.manager == "local"
    cfg = load_config("configs/default.yaml", ["cluster.address=tcp://10.0.0.1:8786"])
    assert cfg.cluster.manager == "address"


def test_slurm_section_round_trips():
    cfg = load_config("configs/default.yaml", [
        "cluster.manager=slurm",
        "cluster.slurm.classes={H800: {gres: 'gpu:h800:1', cores: 8, memory: 64GB}}",
        "cluster.slurm.adapt={minimum: 1, maximum: 6}",
    ])
    c = cfg.cluster
    assert c.class_settings("H800").gres == "gpu:h800:1"
    assert c.class_settings("CPU").cores == 1  # not listed: defaults
    assert (c.slurm.adapt.minimum, c.slurm.adapt.maximum) == (1, 6)


@pytest.mark.parametrize("overrides, fragment", [
    (["cluster.manager=address"], "needs cluster.address"),
    (["cluster.manager=local", "cluster.address=tcp://h:8786"], "set manager: address"),
    (["cluster.manager=slurm", "cluster.address=tcp://h:8786"], "drop address"),
    (["cluster.address=h:8786"], "must look like tcp://host:8786"),
    (["cluster.manager=yarn"], "'cluster.manager'"),
    (["cluster.manager=slurm", "cluster.slurm.classes={TPU: {}}"],
     "cluster.slurm.classes names ['TPU']"),
    (["cluster.manager=slurm", "cluster.slurm.classes={H800: {memory: lots}}"], "4GB"),
    (["cluster.manager=slurm", "cluster.slurm.classes={H800: {gres: 'gpu h800'}}"],
     "gpu:h800:1"),
    (["cluster.manager=slurm", "cluster.slurm.classes={H800: {directives: ['#SBATCH -N1']}}"],
     "without #SBATCH"),
    (["cluster.manager=slurm", "cluster.slurm.walltime=forever"], "04:00:00"),
    (["cluster.manager=slurm", "cluster.slurm.adapt={minimum: 3, maximum: 2}"], "<= adapt"),
    (["cluster.manager=slurm", "cluster.slurm.adapt={minimum: 2, maximum: 4}"],
     "within cluster.slurm.adapt bounds [2, 4]"),
    (["cluster.manager=slurm", "cluster.slurm.adapt={hw_class: H800}"], "only the env class"),
    (["cluster.manager=slurm", "cluster.slurm.adapt={minimum: 0}"], "'cluster.slurm.adapt"),
    (["cluster.manager=slurm", "cluster.workers.CPU=0", "cluster.slurm.adapt=null"], ">= 1"),
    (["cluster.manager=kubernetes", "cluster.kubernetes.classes={H20: {memory: 8GB}}"],
     "Kubernetes quantity"),
    (["cluster.manager=kubernetes", "cluster.kubernetes.name=Roll_Art"], "DNS label"),
    (["cluster.manager=kubernetes",
      "cluster.kubernetes.classes={H20: {tolerations: [{operator: Maybe}]}}"], "operator"),
    (["cluster.manager=kubernetes", "cluster.kubernetes.classes={H20: {gpus: -1}}"], "gpus"),
])
def test_bad_cluster_config_says_how_to_fix(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", overrides)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)
