"""A sharded update checked against one rank, without a cluster: N local processes, one rank
each, meet over gloo and run the trainer's update on the same batch (tests and
`benchmarks/sharded_trainer.py` use it).

    python -m rollart.train.rank_check --world 2 --out DIR [--model tiny|DIR] [--updates 3]
        [--store ROOT --save-at K | --store ROOT --resume-from K] [--uniform-groups N]

Every rank builds the same model (same seed) and the same batch: rows of varying length, two
generated turns each, GRPO-style groups that share a prompt, behaviour log-probs from the start
policy with a little noise (so the off-policy weights are not all 1). Rank 0 writes the full
parameters after the updates (`params.safetensors`) and the metrics of each update
(`metrics.json`); every rank writes what it holds (`rank{r}.json`: parameter, gradient and
optimizer-state bytes counted from its tensors, and its peak RSS). `--save-at K` writes the
trainer's checkpoint after update K into the run store at `--store` (a directory or an S3 URL,
through `RunStore`: shard files from every rank, manifest last); `--resume-from K` loads it
(at this run's world size) and runs the updates after K.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import safetensors.torch
import torch

from rollart.config import AlgoConfig, TrainConfig
from rollart.train.distributed import Ranks, destroy_group, full, init_group, local
from rollart.train.sharded_state import load_pretrained
from rollart.train.trainer import Trainer
from rollart.types import Trajectory


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=96,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).float()


def load_model(spec: str, seed: int, skeleton: bool = False) -> torch.nn.Module:
    """The tiny model, or a local HF directory's: loaded, or (`skeleton`, for a sharded
    trainer) its architecture on the meta device, the weights read shard by shard later."""
    if spec == "tiny":
        return tiny_model(seed)
    from transformers import AutoConfig, AutoModelForCausalLM

    if skeleton:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec),
                                                    dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)


def make_batch(vocab: int, rows: int, seed: int, max_len: int,
               uniform_groups: int = 0) -> list[Trajectory]:
    """`rows` conversations in groups of 4 sharing a prompt: prompt, a generated turn, an
    observation, a generated turn; lengths vary so shares are uneven in rows and tokens. The
    last `uniform_groups` groups scored alike: advantage 0 (rows the trainer leaves out).
    Behaviour log-probs come later (`add_behaviour`)."""
    g = torch.Generator().manual_seed(seed)
    out: list[Trajectory] = []
    first_uniform = (rows + 3) // 4 - uniform_groups
    for i in range(rows):
        grp = i // 4
        gp = torch.Generator().manual_seed(seed * 1000 + grp)
        prompt = torch.randint(3, vocab, (int(torch.randint(8, max_len // 3, (1,), generator=gp)),),
                               generator=gp).tolist()
        a1, obs, a2 = (int(torch.randint(2, max_len // 6, (1,), generator=g)) for _ in range(3))
        toks = prompt + torch.randint(3, vocab, (a1 + obs + a2,), generator=g).tolist()
        mask = [0] * len(prompt) + [1] * a1 + [0] * obs + [1] * a2
        out.append(Trajectory(
            sample_id=f"t/i0/g{grp}/m{i}", task="t", env_id="synthetic", group_id=f"t/i0/g{grp}",
            seed=i, iteration=0, token_ids=toks, loss_mask=mask,
            behaviour_logprobs=[0.0] * len(toks), token_versions=[0 if m else -1 for m in mask],
            advantage=float(torch.randn((), generator=g))))
        if grp >= first_uniform:  # drawn anyway: the other rows stay as without it
            out[-1].advantage = 0.0
    return out


@torch.no_grad()
def add_behaviour(trainer: Trainer, trajs: list[Trajectory], seed: int) -> None:
    """Behaviour log-probs = the start policy's (the trainer's own forward; every rank runs
    every row, so a sharded trainer's collectives line up) + noise, as from a slightly stale
    engine, so the off-policy weights are not all 1."""
    from rollart.train.batch import collate

    g = torch.Generator().manual_seed(seed)
    batch = collate(trajs, 0, trainer._vocab_size())
    if trainer.device.type != "cpu":
        batch = batch.to(trainer.device)
    lp = torch.cat([trainer._logprobs(trainer.model, batch.select(slice(i, i + 4))).cpu()
                    for i in range(0, len(batch), 4)])  # [B, T-1], 0 off model tokens
    for i, t in enumerate(trajs):
        noise = 0.05 * torch.randn(len(t.token_ids) - 1, generator=g)
        t.behaviour_logprobs = [0.0] + [float(lp[i, j] + noise[j]) if m else 0.0
                                        for j, m in enumerate(t.loss_mask[1:])]


def held_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards)."""
    params = list(trainer.policy.parameters())
    p = sum(local(x).numel() * local(x).element_size() for x in params)
    g = sum(local(x.grad).numel() * local(x.grad).element_size() for x in params
            if x.grad is not None)
    o = sum(local(v).numel() * local(v).element_size() for st in trainer.optimizer.state.values()
            for v in st.values() if isinstance(v, torch.Tensor))
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def _store(root: str):  # noqa: ANN202 - RunStore, imported late (keeps this module light)
    from rollart.storage.store import RunStore

    opts = {}
    if root.startswith("s3://"):
        opts = {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL_S3"]}}
    return RunStore(root, "rank-check", storage_options=opts)


def save(trainer: Trainer, root: str, step: int) -> None:
    """The trainer's checkpoint `step` into the store: every rank's shards, then rank 0's meta
    files and the manifest (the path `Checkpointer.save` takes for a sharded trainer)."""
    store = _store(root)
    if trainer.ranks.sharded:
        from rollart.train.distributed import all_gather_json
        from rollart.train.sharded_state import save_shards

        mine = store.write_checkpoint_files(step, save_shards(trainer))
        written = {k: v for part in all_gather_json(mine, trainer.ranks) for k, v in part.items()}
        if trainer.ranks.rank == 0:
            store.save_checkpoint(step, trainer.meta_files(), {}, written)
        all_gather_json(None, trainer.ranks)  # the manifest exists before anyone goes on
    else:
        store.save_checkpoint(step, trainer.checkpoint_files(), {})


def run_rank(rank: int, world: int, port: int, out: Path, model_spec: str, updates: int,
             rows: int, lr: float, micro: int, max_len: int, seed: int, store: str = "",
             save_at: int = 0, resume_from: int = 0, mixed_precision: int = 0,
             uniform_groups: int = 0) -> None:
    torch.set_num_threads(1)
    ranks = Ranks(rank, world)
    if world > 1:
        init_group(ranks, "127.0.0.1", port, timeout_s=300)
    skeleton = world > 1 and model_spec != "tiny"  # no rank loads the whole model
    model = load_model(model_spec, seed, skeleton)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    batch = make_batch(vocab, rows, seed + 1, max_len, uniform_groups)
    algo = AlgoConfig(advantage="grpo", loss="ppo_clip", off_policy="tis", entropy_coef=0.0,
                      kl_coef=0.0, loss_agg="seq_mean_token_mean")
    train = TrainConfig(lr=lr, epochs=1, micro_batch_size=micro, grad_clip=1.0, threads=1,
                        max_kl=0.0)
    trainer = Trainer(model, algo, train, pad_id=0, ranks=ranks,
                      mixed_precision=bool(mixed_precision))
    if skeleton:
        load_pretrained(trainer, model_spec)
    add_behaviour(trainer, batch, seed + 2)  # from the start weights, resumed or not
    if resume_from:
        files, _ = _store(store).load_checkpoint(resume_from)
        trainer.load_checkpoint_files(files)
    metrics, times = [], []
    for u in range(resume_from, updates):
        t0 = time.perf_counter()
        metrics.append(trainer.update(batch))
        times.append(time.perf_counter() - t0)
        if save_at and u + 1 == save_at:
            save(trainer, store, save_at)
            at_save = {k: full(v).detach().cpu().contiguous().clone()
                       for k, v in model.state_dict().items() if k != "lm_head.weight"}
            if rank == 0:
                safetensors.torch.save_file(at_save, str(out / "params_at_save.safetensors"))
    held = held_bytes(trainer)
    state = {k: full(v).detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        safetensors.torch.save_file({k: v for k, v in state.items()
                                     if k != "lm_head.weight"}, str(out / "params.safetensors"))
        (out / "metrics.json").write_text(json.dumps({"metrics": metrics, "update_s": times}))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{rank}.json").write_text(json.dumps({"held_bytes": held, "peak_rss": rss}))
    if world > 1:
        destroy_group()


def launch(world: int, out: Path, **kw: object) -> None:
    """Run `world` ranks as local processes; raises if any fails."""
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    procs = [subprocess.Popen([sys.executable, "-m", "rollart.train.rank_check", "--rank",
                               str(r), "--world", str(world), "--port", str(port), "--out",
                               str(out), *args], env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"rank processes exited with {codes}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None, help="(internal) run one rank")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default="", help="run store root for --save-at/--resume-from")
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume-from", type=int, default=0)
    ap.add_argument("--mixed-precision", type=int, default=0, help="1: bf16 compute (CUDA)")
    ap.add_argument("--uniform-groups", type=int, default=0,
                    help="groups of 4 rows with advantage 0 (left out of the passes)")
    a = ap.parse_args(argv)
    kw = dict(updates=a.updates, rows=a.rows, lr=a.lr, micro=a.micro, max_len=a.max_len,
              seed=a.seed, store=a.store, save_at=a.save_at, resume_from=a.resume_from,
              mixed_precision=a.mixed_precision, uniform_groups=a.uniform_groups)
    if a.rank is not None:
        run_rank(a.rank, a.world, a.port, a.out, model_spec=a.model, **kw)
    else:
        launch(a.world, a.out, model=a.model, **kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
