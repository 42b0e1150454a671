"""Cross-host weight sync: the pipelined chain (rollart/engines/weight_stream.py) against a star
(the sender sends the whole payload to each engine in turn), 1, 2 and 4 engine replicas, each on
its own host: Linux network namespaces (infra/netns.py), so every byte crosses a real TCP stack
between separate network hosts (veth pairs on a bridge) and each process listens only on its
own host's address.

One sender process on host `tx` (the trainer's rank 0) holds a payload with the parameter shapes
of SmolLM2-135M-Instruct in float32 (LlamaConfig: hidden 576, intermediate 1536, 30 layers, 9
heads, 3 KV heads, vocab 49152, tied embeddings: 272 tensors, 538 MB; `--scale` shrinks layers
and vocab for a quick run); one receiver process per engine host `rx0..rx3`. This process (the
root namespace) only says what to do, over the processes' stdin/stdout; the weights never pass
through it. A sync is timed from the sender's start to the last receiver's result (every
process on one machine shares CLOCK_MONOTONIC); opening the receivers (an actor call in the real
system) is not in it. Each receiver checks what it got against the sender's fingerprint.

This box has 2 cores for 1 sender + up to 4 receivers: every receiver copies the whole payload
out of the kernel (and a middle hop copies it in again to forward it), so the CPU work of a sync
grows with the number of engines in both modes. The JSON reports that accounting (bytes copied
through user space, CPU seconds per process and machine-wide, per core) next to the times, and
`--link-mbit` adds runs with each host's link capped (tc tbf on both directions of its veth),
the regime of a real cluster where the network, not one box's two cores, is the limit.

    .venv/bin/python benchmarks/weight_sync.py                  # -> results/weight_sync.json
    .venv/bin/python benchmarks/weight_sync.py --scale 0.05 --repeats 3 --out /tmp/ws.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TARGET_GROWTH = 1.5  # the chain's sync time from 1 to 4 engines may grow at most this much


# ---- payload ------------------------------------------------------------------------------
def smollm2_shapes(scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """Unique parameters of SmolLM2-135M (lm_head is tied to the embedding: listed once),
    in state-dict order; `scale` < 1 keeps that fraction of the layers and vocabulary."""
    from transformers import LlamaConfig

    c = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    tie_word_embeddings=True)
    layers = max(1, round(c.num_hidden_layers * scale))
    vocab = max(64, round(c.vocab_size * scale))
    h, i = c.hidden_size, c.intermediate_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    out = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return [*out, ("model.norm.weight", (h,))]


def fingerprint(tensors: Any) -> float:
    """Sum over every value (float64): a cheap check that all bytes arrived in place."""
    return float(sum(t.double().sum() for t in tensors))


def _cpu_s() -> float:
    return time.process_time()  # user + system, every thread of this process


# ---- the processes on the hosts -------------------------------------------------------------
def _say(**msg: Any) -> None:
    print(json.dumps(msg), flush=True)


def serve_receiver(host: str, cmds: Any) -> None:
    """One engine host: for each `open` line, a WeightReceiver; prints its address, then its
    result (stats, CPU seconds, fingerprint)."""
    sys.path.insert(0, str(ROOT))
    from rollart.engines.weight_stream import WeightReceiver

    _say(ready=True)
    keep = tensors = None  # the previous sync's staging tensors, received into again (as an
    # engine would)
    for line in cmds:
        cmd = json.loads(line)
        cpu0 = _cpu_s()
        rx = WeightReceiver(host, bytes.fromhex(cmd["token"]), cmd["timeout_s"],
                            sock_buf=cmd.get("sock_buf"),
                            buffers=None if cmd.get("fresh") else keep)
        keep = tensors = None  # rx holds the buffers it may reuse; the rest is freed
        _say(address=list(rx.address))
        try:
            _, tensors, stats = rx.result(timeout=cmd["timeout_s"] * 4)
            cpu = _cpu_s() - cpu0
            _say(ok=True, stats=stats, cpu_s=cpu, fingerprint=fingerprint(tensors.values()))
            keep = tensors
        except Exception as err:  # noqa: BLE001 - reported to the parent
            _say(ok=False, error=str(err))
        finally:
            rx.close()


def serve_sender(scale: float, seed: int, cmds: Any) -> None:
    """The trainer's rank 0: makes the payload once, then one sync per `send` line."""
    sys.path.insert(0, str(ROOT))
    import torch

    from rollart.engines.weight_stream import send_weights

    g = torch.Generator().manual_seed(seed)
    state = {n: torch.randn(s, generator=g) for n, s in smollm2_shapes(scale)}
    _say(ready=True, bytes=sum(t.numel() * 4 for t in state.values()), tensors=len(state),
         fingerprint=fingerprint(state.values()))
    for line in cmds:
        cmd = json.loads(line)
        cpu0 = _cpu_s()
        t_start = time.monotonic()
        try:
            stats = send_weights([tuple(a) for a in cmd["chain"]], bytes.fromhex(cmd["token"]),
                                 cmd["version"], state, mode=cmd["mode"],
                                 chunk_bytes=cmd["chunk_bytes"], timeout_s=cmd["timeout_s"],
                                 sock_buf=cmd.get("sock_buf"))
            _say(ok=True, t_start=t_start, stats=stats, cpu_s=_cpu_s() - cpu0)
        except Exception as err:  # noqa: BLE001 - reported to the parent
            _say(ok=False, error=str(err))


# ---- the driver (root namespace) ----------------------------------------------------------
class Proc:
    """A child on a host, driven by JSON lines: commands through a pipe it inherits as
    `--cmd-fd` (NetnsHosts.popen gives children no stdin), answers on its stdout."""

    def __init__(self, hosts: Any, host: str, argv: list[str], log: Path) -> None:
        self.name = host
        r, w = os.pipe()
        self.p = hosts.popen(host, [*argv, "--cmd-fd", str(r)], cwd=ROOT, pass_fds=(r,),
                             stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        os.close(r)
        self.cmds = os.fdopen(w, "w")

    def send(self, **msg: Any) -> None:
        self.cmds.write(json.dumps(msg) + "\n")
        self.cmds.flush()

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (rc {self.p.poll()}); see its log")
        return json.loads(line)


def _machine_busy_s() -> float:
    """CPU seconds spent (all cores, all processes, incl. softirq) since boot: /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def one_sync(sender: Proc, rxs: list[Proc], mode: str, payload: dict[str, Any],
             chunk: int, sock_buf: int | None, timeout_s: float, version: int,
             fresh: bool = False) -> dict[str, Any]:
    # what the rest of the box (other users' work) takes just before: our processes are idle
    busy0, w0 = _machine_busy_s(), time.monotonic()
    time.sleep(0.5)
    background = (_machine_busy_s() - busy0) / (time.monotonic() - w0)
    token = secrets.token_hex(32)  # fresh per sync, as the real system would pass it
    for r in rxs:
        r.send(token=token, timeout_s=timeout_s, sock_buf=sock_buf, fresh=fresh)
    chain = [r.read()["address"] for r in rxs]
    busy1, w1 = _machine_busy_s(), time.monotonic()  # the sync starts here
    sender.send(chain=chain, token=token, version=version, mode=mode, chunk_bytes=chunk,
                timeout_s=timeout_s, sock_buf=sock_buf)
    s = sender.read()  # the chain acks only after every receiver has everything
    busy2, w2 = _machine_busy_s(), time.monotonic()
    got = [r.read() for r in rxs]
    bad = [g.get("error") for g in got if not g["ok"]] + ([s["error"]] if not s["ok"] else [])
    if bad:
        raise RuntimeError(f"sync failed: {bad}")
    for g in got:
        if abs(g["fingerprint"] - payload["fingerprint"]) > 1e-6 * max(1.0, abs(
                payload["fingerprint"])):
            raise RuntimeError(f"payload mismatch: {g['fingerprint']} != {payload}")
    nbytes, m = payload["bytes"], len(rxs)
    sync_s = max(g["stats"]["done_monotonic"] for g in got) - s["t_start"]
    # user-space copies: the sender writes P once (chain) or M times (star); every receiver
    # reads P, and in the chain every hop but the last writes it again
    copied = nbytes * ((1 + m + (m - 1)) if mode == "chain" else 2 * m)
    return {"mode": mode, "engines": m, "sync_s": sync_s, "mb_per_s": nbytes / 1e6 / sync_s,
            "sender_s": s["stats"]["seconds"], "sender_cpu_s": s["cpu_s"],
            "receiver_cpu_s": [g["cpu_s"] for g in got],
            "first_byte_wait_s": [g["stats"]["first_byte_wait_s"] for g in got],
            "our_cpu_s": s["cpu_s"] + sum(g["cpu_s"] for g in got),
            "machine_busy_cores": (busy2 - busy1) / (w2 - w1),
            "background_busy_cores_before": background,
            "reused_buffers": [g["stats"]["reused_buffers"] for g in got],
            "user_space_bytes_copied": copied,
            "user_space_gb_copied_per_our_cpu_s": copied / 1e9 / max(
                s["cpu_s"] + sum(g["cpu_s"] for g in got), 1e-9)}


def _shape_links(hosts: Any, mbit: int) -> None:
    """Cap each host's link to `mbit` in both directions (a NIC's rate): tbf on the inside end
    of its veth (what it sends) and on the bridge end (what it receives)."""
    burst = max(256 << 10, mbit * 1_000_000 // 8 // 250)  # >= 4 ms at rate, >= 64 kB segments
    for h in hosts.hosts.values():
        for prefix, dev in ((["ip", "netns", "exec", h.netns], f"{h.veth}p"), ([], h.veth)):
            subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                            f"{mbit}mbit", "burst", str(burst), "latency", "50ms"], check=True)


def _summary(trials: list[dict[str, Any]], counts: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("chain", "star"):
        per = {}
        for m in counts:
            xs = sorted(t["sync_s"] for t in trials if t["mode"] == mode and t["engines"] == m)
            if xs:
                sel = [t for t in trials if t["mode"] == mode and t["engines"] == m]
                per[str(m)] = {"median_s": statistics.median(xs), "min_s": xs[0],
                               "max_s": xs[-1], "n": len(xs),
                               "spread_pct": 100 * (xs[-1] - xs[0]) / statistics.median(xs),
                               "mb_per_s_median": trials[0]["payload_mb"] /
                               statistics.median(xs),
                               "our_cpu_s_median": statistics.median(
                                   t["our_cpu_s"] for t in sel),
                               # per host: what one machine of a real cluster would spend
                               "sender_cpu_s_median": statistics.median(
                                   t["sender_cpu_s"] for t in sel),
                               "busiest_receiver_cpu_s_median": statistics.median(
                                   max(t["receiver_cpu_s"]) for t in sel),
                               "machine_busy_cores_median": statistics.median(
                                   t["machine_busy_cores"] for t in sel),
                               "background_busy_cores_median": statistics.median(
                                   t["background_busy_cores_before"] for t in sel)}
        out[mode] = per
        if "1" in per and "4" in per:
            growth = per["4"]["median_s"] / per["1"]["median_s"]
            out[f"sync_growth_1_to_4_engines_{mode}"] = growth
            out[f"within_target_{TARGET_GROWTH}x_{mode}"] = growth <= TARGET_GROWTH
    return out


def host_facts() -> dict[str, Any]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            return ""
    model = [ln.split(":", 1)[1].strip() for ln in read("/proc/cpuinfo").splitlines()
             if ln.startswith("model name")]
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout
    import torch

    return {"cpu_model": model[0] if model else "", "nproc": os.cpu_count(),
            "boot_id": read("/proc/sys/kernel/random/boot_id").strip(),
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "git_commit": commit.strip(),
            "git_dirty_files": len(dirty.splitlines()),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "loadavg_at_start": read("/proc/loadavg").split()[:3]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from infra.netns import NetnsHosts

    counts = [int(x) for x in args.engines.split(",")]
    names = [f"rx{i}" for i in range(max(counts))]
    py = sys.executable
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    facts = host_facts()
    with NetnsHosts(["tx", *names]) as hosts:
        me = [py, str(Path(__file__).resolve())]
        rxs = [Proc(hosts, n, [*me, "--role", "receiver", "--host", hosts.addr(n)],
                    logs / f"{n}.log") for n in names]
        sender = Proc(hosts, "tx", [*me, "--role", "sender", "--scale", str(args.scale),
                                    "--seed", str(args.seed)], logs / "tx.log")
        payload = sender.read()
        for r in rxs:
            r.read()
        mb = payload["bytes"] / 1e6
        version = 0
        chunk, sock_buf = args.chunk_mib * MiB, (args.sock_buf_kib << 10) or None

        def trial(mode: str, m: int, chunk: int = chunk, sock_buf: int | None = sock_buf,
                  fresh: bool = False, **extra: Any) -> dict[str, Any]:
            nonlocal version
            version += 1
            t = one_sync(sender, rxs[:m], mode, payload, chunk, sock_buf, args.timeout_s,
                         version, fresh)
            t.update(payload_mb=mb, chunk_bytes=chunk, sock_buf=sock_buf, **extra)
            print(f"  {mode:5s} x{m} chunk {chunk >> 20} MiB buf {sock_buf} "
                  f"{extra or ''}: {t['sync_s']:.3f} s", file=sys.stderr, flush=True)
            return t

        warmup = [trial("chain", max(counts)), trial("star", max(counts))]
        sweep = []
        for _ in range(args.sweep_repeats):
            for c in (1, 4, 8):
                for b in (None, 4 * MiB):
                    sweep.append(trial("chain", min(2, max(counts)), c * MiB, b))
        trials = [trial(mode, m) for _ in range(args.repeats) for m in counts
                  for mode in ("chain", "star")]
        # the same with a fresh staging buffer per sync (no `buffers=` reuse)
        fresh = [trial(mode, max(counts), fresh=True, fresh_buffers=True)
                 for _ in range(args.repeats) for mode in ("chain", "star")]
        shaped: list[dict[str, Any]] = []
        sweep_capped: list[dict[str, Any]] = []
        if args.link_mbit:
            _shape_links(hosts, args.link_mbit)
            # the pipeline's fill time: each hop forwards a chunk once it has all of it
            sweep_capped = [trial("chain", max(counts), c * MiB, None, link_mbit=args.link_mbit)
                            for _ in range(args.sweep_repeats) for c in (1, 4, 8)]
            shaped = [trial(mode, m, link_mbit=args.link_mbit) for _ in range(args.repeats)
                      for m in counts for mode in ("chain", "star")]
        for p in [sender, *rxs]:
            p.cmds.close()  # they end at EOF
    left = hosts.leftovers()  # NetnsHosts removed them on exit (also on an error)
    sweep_summary = {}
    for c in (1, 4, 8):
        for b in (None, 4 * MiB):
            xs = [t["sync_s"] for t in sweep if t["chunk_bytes"] == c * MiB
                  and t["sock_buf"] == b]
            if xs:
                sweep_summary[f"chunk_{c}MiB_buf_{'auto' if b is None else '4MiB'}"] = {
                    "median_s": statistics.median(xs), "all_s": xs}
    return {
        "benchmark": "weight_sync",
        "command": " ".join([".venv/bin/python", "benchmarks/weight_sync.py", *sys.argv[1:]]),
        "host": facts,
        "payload": {"model": "SmolLM2-135M-Instruct shapes (unique parameters; lm_head tied)",
                    "dtype": "float32", "bytes": payload["bytes"], "tensors": payload["tensors"],
                    "scale": args.scale},
        "setup": {"hosts": "network namespaces on one bridge (infra/netns.py): tx (sender), "
                           f"rx0..rx{len(names) - 1} (one receiver process each)",
                  "engine_counts": counts, "repeats": args.repeats,
                  "chunk_bytes": chunk, "sock_buf": sock_buf or "kernel autotuning",
                  "timeout_s": args.timeout_s,
                  "timing": "sender start -> last receiver's result (CLOCK_MONOTONIC, shared); "
                            "opening receivers is not timed",
                  "cpu_accounting": "user_space_bytes_copied: payload bytes moved between "
                                    "kernel and user space in the sync (chain: sender 1 + each "
                                    "receiver 1 + each forwarding hop 1 = 2M payloads; star: "
                                    "sender M + receivers M = 2M); our_cpu_s: user+system "
                                    "CPU seconds of the sender and receiver processes over "
                                    "the sync (all threads); machine_busy_cores: /proc/stat "
                                    "busy over the sync / its wall time (every process, "
                                    "softirq included; at most nproc); "
                                    "background_busy_cores_before: the same over 0.5 s just "
                                    "before, while our processes idle (other work on the "
                                    "box)"},
        "choices": {
            "chunk_bytes": "4 MiB (rollart.engines.weight_stream.CHUNK_BYTES). A hop forwards "
                           "a chunk once it holds all of it, so each hop adds chunk/link-rate "
                           "to the sync (4 MiB: 34 ms at 1 Gbit/s, 1.3 ms at 25 Gbit/s); "
                           "smaller chunks cost more syscalls and thread hand-offs per byte "
                           "where the CPU is the limit. See the two sweeps: on this box the "
                           "differences are small next to the noise.",
            "sock_buf": "kernel autotuning (None): a fixed SO_SNDBUF/SO_RCVBUF turns "
                        "autotuning off and is capped by net.core.[rw]mem_max (4 MiB here), "
                        "which would cap throughput on a high bandwidth-delay link; the uncapped "
                        "sweep shows what a fixed 4 MiB does here.",
            "buffers": "each receiver process passes its previous sync's tensors as "
                       "`buffers=` (what an engine does every iteration); "
                       "summary_fresh_buffers is the same without reuse (fresh, page-faulted "
                       "staging memory per sync)"},
        "summary": _summary(trials, counts),
        "summary_link_capped": _summary(shaped, counts) if shaped else None,
        "summary_fresh_buffers": _summary(fresh, [max(counts)]),
        "link_mbit": args.link_mbit or None,
        "sweep_chunk_and_buffers": {"engines": min(2, max(counts)), "mode": "chain",
                                    "results": sweep_summary},
        "sweep_chunk_link_capped": {
            "engines": max(counts), "mode": "chain", "link_mbit": args.link_mbit or None,
            "results": {f"chunk_{c}MiB": [t["sync_s"] for t in sweep_capped
                                          if t["chunk_bytes"] == c * MiB] for c in (1, 4, 8)}},
        "namespaces_left_after": left,
        "warmup": warmup, "trials": trials, "trials_fresh_buffers": fresh,
        "trials_link_capped": shaped,
    }


def summary_line(out: dict[str, Any]) -> str:
    def part(s: dict[str, Any], label: str) -> str:
        bits = []
        for mode in ("chain", "star"):
            per = s[mode]
            ts = "/".join(f"{per[k]['median_s']:.2f}" for k in sorted(per, key=int))
            bits.append(f"{mode} {ts} s (growth 1->4 "
                        f"{s.get(f'sync_growth_1_to_4_engines_{mode}', float('nan')):.2f}x)")
        return f"{label}: " + ", ".join(bits)
    engines = "/".join(str(c) for c in out["setup"]["engine_counts"])
    line = (f"weight_sync {out['payload']['bytes'] / 1e6:.0f} MB to {engines} engines, "
            + part(out["summary"], "uncapped"))
    if out["summary_link_capped"]:
        line += "; " + part(out["summary_link_capped"], f"links at {out['link_mbit']} Mbit/s")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["driver", "receiver", "sender"], default="driver")
    ap.add_argument("--host", help="receiver: the address to listen on")
    ap.add_argument("--cmd-fd", type=int, help="receiver/sender: the driver's commands")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep-repeats", type=int, default=2)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--sock-buf-kib", type=int, default=0, help="0: kernel autotuning")
    ap.add_argument("--link-mbit", type=int, default=0, help="also run with links capped")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--out", default=str(ROOT / "results/weight_sync.json"))
    ap.add_argument("--logs", default="/tmp/weight_sync_logs")
    args = ap.parse_args()
    if args.role == "receiver":
        return serve_receiver(args.host, os.fdopen(args.cmd_fd))
    if args.role == "sender":
        return serve_sender(args.scale, args.seed, os.fdopen(args.cmd_fd))
    out = run(args)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(summary_line(out))


if __name__ == "__main__":
    main()
