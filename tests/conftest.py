import os

# No hub downloads, ever; keep torch to one thread so tests share the 2 cores fairly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
# A flow must reach the server a test started, never a hidden ephemeral one Prefect would
# otherwise start by itself when it finds no PREFECT_API_URL.
os.environ.setdefault("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "false")


import pytest  # noqa: E402

from rollart.types import Trajectory, Turn  # noqa: E402


@pytest.fixture
def make_traj():
    """A small scored trajectory factory shared by store and reward tests."""

    def make(i: int, **kw) -> Trajectory:
        turn = Turn(0, "obs", "<answer>Left</answer>", "Left", True, 0.0, 10, 3, 0, 0.1, 0.01)
        return Trajectory(
            sample_id=f"s{i}", task="frozenlake", env_id="FrozenLake-v1", group_id="g", seed=i,
            iteration=0, token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
            behaviour_logprobs=[0, -1, -2], token_versions=[-1, 0, 0], turns=[turn], reward=1.0,
            reward_details={"success": 1.0}, timings={"env_s": 0.5}, **kw,
        )

    return make
