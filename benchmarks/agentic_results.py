"""The results side of `benchmarks/agentic_vs_trl.py`: reading a rollart run's stored
trajectories and metrics, the signal counts of both sides, earlier TRL runs, host facts and the
headline summary (ratios pooled over seeds)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script, too

import torch  # noqa: E402

from benchmarks.agentic_episodes import Match, Tally  # noqa: E402


def read_shards(run_dir: Path) -> tuple[Tally, list[dict[int, int]]]:
    """(counts over the run's stored (trained) trajectories, each step's {group index: seed}:
    index g < num_groups is the plan's slot g, g + k * num_groups its k-th replacement under
    `rollout.resample_uniform`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollart.rollout.ids import parse_group_id
    from rollart.types import table_to_trajectories

    files = sorted((run_dir / "trajectories").glob("*/*.parquet"))
    trajs = table_to_trajectories(pa.concat_tables([pq.read_table(f) for f in files]))
    seeds: dict[int, dict[str, int]] = {}
    for t in trajs:
        seeds.setdefault(t.iteration, {})[t.group_id] = t.seed
    order = [{parse_group_id(g)[2]: seed for g, seed in by.items()}
             for _, by in sorted(seeds.items())]
    return Tally().add(trajs), order


def plays_plan(played: list[dict[int, int]], planned: list[list[int]]) -> bool:
    """Every step filled every planned slot, and a slot's planned group, where it was trained
    (not replaced), had the planned seed."""
    n = len(planned[0]) if planned else 0
    return len(played) == len(planned) and all(
        sorted(g % n for g in step) == list(range(n))
        and all(seed == plan[g] for g, seed in step.items() if g < n)
        for step, plan in zip(played, planned, strict=True))


def rollart_signal(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Groups whose episodes all scored alike (no advantage), and updates without gradient."""
    return {"uniform_groups": int(sum(r.get("reward/zero_variance_groups", 0) for r in rows)),
            "updates_without_gradient": sum(1 for r in rows if r.get("train/no_signal")
                                            or r.get("train/grad_norm") == 0.0)}


def trl_signal(res: dict[str, Any], groups: int) -> dict[str, int]:
    """The same counts from TRL's logs (`frac_reward_zero_std` per step: the share of groups
    whose rewards have zero std)."""
    return {"uniform_groups": round(sum(f * groups for f in res.get("frac_reward_zero_std", [])
                                        if f is not None)),
            "updates_without_gradient": sum(1 for g in res.get("grad_norm", []) if g == 0.0)}


def final_state(run_dir: str) -> dict[str, torch.Tensor]:
    import safetensors.torch

    ckpts = sorted(Path(run_dir, "checkpoints").glob("*/model.safetensors"))
    if not ckpts:
        sys.exit(f"no checkpoint under {run_dir}/checkpoints")
    return safetensors.torch.load(ckpts[-1].read_bytes())


def earlier_trl_runs(files: str, m: Match, held: list[int], seeds: list[int],
                     runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add to `runs` the TRL runs of `seeds` from earlier results files of the same settings
    and held-out set (TRL's runs are deterministic: the same seed gave the same tokens and
    held-out success on two hosts); returns where each came from (its host and commit)."""
    out = []
    for name in [f for f in files.split(",") if f]:
        d = json.loads(Path(name).read_text())
        if d["settings"] != m.to_json() or d["held_out_seeds"] != held:
            sys.exit(f"{name}: other settings or held-out seeds than this run's")
        got = [r for r in d["runs"] if r["framework"] == "trl" and r["seed"] in seeds
               and not any(x["framework"] == "trl" and x["seed"] == r["seed"] for x in runs)]
        runs += [{**r, "from_file": name} for r in got]
        out.append({"file": name, "seeds": [r["seed"] for r in got],
                    **{k: d["host"].get(k) for k in ("commit", "date", "boot_id", "cpu")}})
    return out


def host_facts() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()

    return {"cpu": cpu, "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "boot_id": read("/proc/sys/kernel/random/boot_id").strip(),
            "hostname": platform.node(), "commit": git("rev-parse", "HEAD"),
            "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "loadavg_start": read("/proc/loadavg").split()[:3], "python": platform.python_version(),
            "torch": torch.__version__}


def summarise(runs: list[dict[str, Any]], base: float, seeds: list[int]) -> dict[str, Any]:
    """Headline fields: success gains (per seed and mean), whole-run rate ratios, step times."""
    out: dict[str, Any] = {}
    by = {fw: {r["seed"]: r for r in runs if r["framework"] == fw} for fw in ("rollart", "trl")}
    for fw, mine in by.items():
        gains = {str(s): mine[s]["held_out"]["success_rate"] - base for s in seeds if s in mine}
        out[f"{fw}_success_gain"] = statistics.mean(gains.values()) if gains else None
        out[f"{fw}_success_gain_per_seed"] = gains
        steps = [x for r in mine.values() for x in r["step_s"]]
        out.setdefault("step_s", {})[fw] = statistics.median(steps) if steps else None
        out["step_s"][f"{fw}_per_seed"] = {str(s): statistics.median(r["step_s"])
                                           for s, r in mine.items()}
    both = [s for s in seeds if s in by["rollart"] and s in by["trl"]]

    def rate(rs: list[dict[str, Any]], key: str, tally: str) -> float:
        # TRL trains all it generates: its "tally" is both
        return (sum(r.get(tally, r["tally"])[key] for r in rs)
                / sum(r["wall_s"] for r in rs))

    # "tally": every episode played; "tally_trained": those trained (rollart sets aside groups
    # under rollout.resample_uniform, and those episodes count only in the first)
    trained = any("tally_trained" in r and r["tally_trained"] != r["tally"] for r in runs)
    for tally, prefix in (("tally", ""), ("tally_trained", "trained_")):
        if prefix and not trained:
            continue
        for key, name in (("model_tokens", f"{prefix}tokens_per_s_ratio"),
                          ("env_steps", f"{prefix}env_steps_per_s_ratio")):
            if not both:
                out[name] = None
                continue
            out[name] = rate([by["rollart"][s] for s in both], key, tally) / rate(
                [by["trl"][s] for s in both], key, tally)
            out[f"{name}_per_seed"] = {
                str(s): rate([by["rollart"][s]], key, tally) / rate([by["trl"][s]], key, tally)
                for s in both}
    return out


def pooled(files: list[str], only: list[int] | None = None) -> dict[str, Any]:
    """One summary over the runs of several results files of the same settings and held-out
    set (seeds run in separate invocations): `summarise` over all their runs (of the seeds in
    `only`, when given), plus each side's sample standard deviation of the per-seed gains and
    the standard error of the difference of the mean gains, sqrt(sd_r^2 / n_r + sd_t^2 / n_t)."""
    docs = [json.loads(Path(f).read_text()) for f in files]
    first = docs[0]
    for name, d in zip(files, docs, strict=True):
        if (d["settings"], d["held_out_seeds"]) != (first["settings"], first["held_out_seeds"]):
            sys.exit(f"{name}: other settings or held-out seeds than {files[0]}'s")
    runs: list[dict[str, Any]] = []
    for d in docs:  # a seed's run of a side once: the first file that has it
        runs += [r for r in d["runs"] if not any(
            (x["framework"], x["seed"]) == (r["framework"], r["seed"]) for x in runs)]
    if only is not None:
        runs = [r for r in runs if r["seed"] in only]
    seeds = sorted({r["seed"] for r in runs})
    out = {"files": files, "seeds": seeds, **summarise(runs, first["base_success"], seeds),
           # an interrupted invocation's file holds the runs it finished (older files predate
           # the flag and were written whole)
           "incomplete_files": [f for f, d in zip(files, docs, strict=True)
                                if d.get("complete") is False]}
    sds = {}
    for fw in ("rollart", "trl"):
        gains = list(out[f"{fw}_success_gain_per_seed"].values())
        sds[fw] = (statistics.stdev(gains), len(gains)) if len(gains) > 1 else None
        out[f"{fw}_success_gain_sd"] = sds[fw][0] if sds[fw] else None
    if sds["rollart"] and sds["trl"]:
        se = sum(sd * sd / n for sd, n in sds.values()) ** 0.5
        out["success_gain_diff_se"] = se
        if se > 0:  # the difference in standard errors, and how often chance gives as much
            z = (out["rollart_success_gain"] - out["trl_success_gain"]) / se
            out["success_gain_diff_z"] = z
            out["success_gain_diff_pvalue"] = math.erfc(abs(z) / math.sqrt(2))  # two-sided
    out["train_success_by_steps"] = train_success_by_steps(runs)
    out["totals"] = side_totals(runs)
    return out


COUNTED = ("model_tokens", "env_steps")  # from each run's tally
SIGNAL = ("uniform_groups", "updates_without_gradient")  # each run's own fields


def side_totals(runs: list[dict[str, Any]]) -> dict[str, dict[str, int | None]]:
    """Each side's sums over its runs: generated tokens and env steps, groups whose episodes
    all scored alike and updates without gradient (None where a run lacks the field)."""
    out = {}
    for fw in ("rollart", "trl"):
        mine = [r for r in runs if r["framework"] == fw]
        sums: dict[str, int | None] = {k: sum(r["tally"][k] for r in mine) for k in COUNTED}
        for k in SIGNAL:
            sums[k] = (sum(r[k] for r in mine)
                       if all(r.get(k) is not None for r in mine) else None)
        out[fw] = sums
    return out


def step_success(run: dict[str, Any]) -> list[float]:
    """Training success of each step of a run (rollart's rows; TRL's `per_step`)."""
    if run["framework"] == "rollart":
        return list(run["success_rate"])
    return [s["success_rate"] for s in run["per_step"]]


def train_success_by_steps(runs: list[dict[str, Any]], block: int = 5) -> dict[str, Any]:
    """Each side's mean training success over every `block` steps, mean over its seeds (both
    sides play the same env seeds each step): where the two sides' learning parts."""
    out: dict[str, Any] = {"block": block}
    for fw in ("rollart", "trl"):
        per = [step_success(r) for r in runs if r["framework"] == fw]
        if not per:
            continue
        n = min(len(x) for x in per)
        out[fw] = [statistics.mean(statistics.mean(x[k:k + block]) for x in per)
                   for k in range(0, n, block)]
    return out


if __name__ == "__main__":
    # python benchmarks/agentic_results.py [--seeds 0,1] [--out F] results/a.json ...:
    # pooled figures (over those seeds only, with --seeds); a seed's run of a side comes from
    # the first file that has it, so list the files whose runs should count first
    import argparse

    ap = argparse.ArgumentParser(description="pooled figures over agentic_vs_trl results files")
    ap.add_argument("--seeds", default=None, help="comma-separated: pool these seeds only")
    ap.add_argument("--out", default=None, help="also write them (with each file's host) here")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    only = [int(x) for x in a.seeds.split(",")] if a.seeds else None
    got = pooled(a.files, only)
    if a.out:
        hosts = {f: json.loads(Path(f).read_text())["host"] for f in a.files}
        Path(a.out).write_text(json.dumps({"benchmark": "agentic_vs_trl_pooled",
                                           "command": " ".join([sys.executable, *sys.argv]),
                                           **got, "hosts": hosts}, indent=1) + "\n")
    print(json.dumps(got, indent=1))
