"""A training run that mixes a prefill-heavy and a decode-heavy task on two emulated engine
pools (configs/affinity-mix.yaml, local loop): each task keeps its share, the task profiles see
the difference, and the router reports where each task's turns ran."""

from pathlib import Path

from rollart.config import load_config
from rollart.local_loop import run_local

CONFIG = str(Path(__file__).parents[2] / "configs" / "affinity-mix.yaml")


def test_mixed_tasks_on_two_pools(tmp_path):
    cfg = load_config(CONFIG, ["iterations=2", f"storage.root={tmp_path}", "storage.shards=false",
                               "rollout.num_groups=2", "rollout.group_size=4",
                               "routing.emulation.time_scale=1"])  # fast: real passes overrun
    out = run_local(cfg, "mix")
    last = out["curve"][-1]
    assert last["rollout/lake8/episodes"] == 4 and last["rollout/arith/episodes"] == 4
    p = "rollout/profile"
    # A map per turn and a 3-token action vs a short problem and a long answer: the online
    # profiles tell the prefill-heavy task from the decode-heavy one.
    ratio = f"{p}/lake8/prefill_decode_ratio", f"{p}/arith/prefill_decode_ratio"
    assert last[ratio[0]] > 4 * last[ratio[1]], (last[ratio[0]], last[ratio[1]])
    assert last[f"{p}/arith/decode_tokens"] > 3 * last[f"{p}/lake8/decode_tokens"]
    placed = {k: v for k, v in last.items() if "/turns_on/" in k}
    assert {k.split("/")[2] for k in placed} == {"lake8", "arith"}, placed
    assert last["rollout/router/routed/engine-0"] + last["rollout/router/routed/engine-1"] > 0
    # Each replica emulated its class: modelled service time for every pass it ran.
    stats = [e.engine.stats() for e in out["engines"]]
    assert all(s["emulated_modelled_s"] > 0 for s in stats), stats
    # The prefill-heavy task's turns ran mostly on the compute pool (the router's choice).
    assert last["rollout/router/lake8/turns_on/H800"] > last.get(
        "rollout/router/lake8/turns_on/H20", 0.0)
