"""A training run that mixes a prefill-heavy and a decode-heavy task on two emulated engine
pools (configs/affinity-mix.yaml, local loop): each task keeps its share, the task profiles see
the difference, the router reports where each task's turns ran, and training and held-out
evaluation report their figures per task (`rollout/task/<name>/...`, `eval/task/<name>/...`)."""

from pathlib import Path

from rollart.config import load_config
from rollart.runner.local_loop import run_local

CONFIG = str(Path(__file__).parents[2] / "configs" / "affinity-mix.yaml")
FIGURES = ("episodes", "success_rate", "env_return", "episode_len", "format_error_rate",
           "response_len", "prompt_len")


def test_mixed_tasks_on_two_pools(tmp_path):
    cfg = load_config(CONFIG, ["iterations=2", f"storage.root={tmp_path}", "storage.shards=false",
                               "rollout.num_groups=2", "rollout.group_size=4",
                               "routing.emulation.time_scale=1",  # fast: real passes overrun
                               "eval.episodes=2"])  # one held-out episode per task, at the end
    out = run_local(cfg, "mix")
    last = out["curve"][-1]
    lake, arith = "rollout/task/lake8", "rollout/task/arith"
    assert last[f"{lake}/episodes"] == 4 and last[f"{arith}/episodes"] == 4
    for t in (lake, arith):
        assert {f"{t}/{k}" for k in FIGURES} <= set(last), sorted(last)
        assert 0.0 <= last[f"{t}/success_rate"] <= 1.0
    # the tasks' profiles in the batch's own figures: one turn of arithmetic vs up to six moves,
    # a map per turn (prefill tokens) vs a long answer (decode tokens)
    assert last[f"{arith}/episode_len"] == 1.0 and last[f"{lake}/episode_len"] >= 1.0
    ratio = {t: last[f"{t}/prompt_len"] / last[f"{t}/response_len"] for t in (lake, arith)}
    assert ratio[lake] > 4 * ratio[arith], ratio
    assert last[f"{arith}/response_len"] > 3 * last[f"{lake}/response_len"]
    # held-out greedy evaluation: each task gets its episode and its own success rate
    assert last["eval/task/lake8/episodes"] == 1 and last["eval/task/arith/episodes"] == 1
    assert {"eval/task/lake8/success_rate", "eval/task/arith/success_rate"} <= set(last)
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
