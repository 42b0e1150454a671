"""Checkpoint save/load throughput to SeaweedFS S3 vs a plain boto3 multipart upload.

Builds a real checkpoint (Trainer.checkpoint_files(): safetensors weights, AdamW state, RNG,
trainer state) of a wider tiny-Llama (default ~130 MB), starts `weed mini` on loopback (or uses
--endpoint-url with AWS_* credentials from the environment), then for `--repeats` rounds:

- save: `RunStore.save_checkpoint` (what the background uploader runs: every file, manifest
  last, CRC32s) and `RunStore.load_checkpoint` (ranged concurrent reads, verified);
- baseline: boto3 `upload_fileobj` / `download_fileobj` (managed multipart, 8 MiB parts,
  10 threads) of the same files' bytes to the same bucket.

Writes results/checkpoint_s3.json (medians) and prints one summary line, e.g.
    checkpoint_s3: 131 MB save 180 MB/s (boto3 190 MB/s, ratio 0.95) load 300 MB/s ...
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_checkpoint(hidden: int, layers: int, intermediate: int) -> dict[str, bytes]:
    import torch

    from rollart.config import AlgoConfig, TaskConfig, TinyModelConfig, TrainConfig
    from rollart.envs import make_env
    from rollart.models.policy import build_tiny_model
    from rollart.models.tokenizer import build_tokenizer
    from rollart.train.trainer import Trainer

    torch.set_num_threads(1)
    tok = build_tokenizer(make_env(TaskConfig()).corpus_texts(episodes=3), 320)
    tiny = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                           num_kv_heads=hidden // 64, intermediate_size=intermediate)
    model = build_tiny_model(tiny, tok, seed=0)
    trainer = Trainer(model, AlgoConfig(), TrainConfig(), pad_id=int(tok.pad_token_id or 0))
    for p in model.parameters():  # one optimizer step so the AdamW moments exist
        p.grad = torch.full_like(p, 1e-3)
    trainer.optimizer.step()
    return trainer.checkpoint_files()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--endpoint-url", default=None, help="existing S3 endpoint (AWS_* creds)")
    ap.add_argument("--bucket", default="rollart")
    ap.add_argument("--out", default=str(ROOT / "results" / "checkpoint_s3.json"))
    args = ap.parse_args()

    import boto3
    from boto3.s3.transfer import TransferConfig

    from infra.seaweed import start_seaweed
    from rollart.config import StorageConfig
    from rollart.storage.store import RunStore

    t0 = time.perf_counter()
    files = build_checkpoint(args.hidden, args.layers, args.intermediate)
    build_s = time.perf_counter() - t0
    nbytes = sum(map(len, files.values()))

    server = None
    tmp = tempfile.mkdtemp(prefix="rollart-bench-s3-")
    if args.endpoint_url:
        endpoint = args.endpoint_url
        key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    else:
        server = start_seaweed(tmp, bucket=args.bucket)
        endpoint, key, secret = server.endpoint_url, server.access_key, server.secret_key
        os.environ.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    try:
        cfg = StorageConfig(root=f"s3://{args.bucket}/bench", endpoint_url=endpoint)
        store = RunStore.from_config(cfg, "checkpoint-bench")
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key,
                              aws_secret_access_key=secret, region_name="us-east-1")
        transfer = TransferConfig()  # boto3 defaults: 8 MiB multipart, 10 threads
        save, load, b_save, b_load = [], [], [], []
        for r in range(args.repeats + 1):  # round 0 warms connections and volumes up
            t = time.perf_counter()
            store.save_checkpoint(r + 1, files, {"bench": True})
            save.append(time.perf_counter() - t)
            t = time.perf_counter()
            back, _ = store.load_checkpoint(r + 1)
            load.append(time.perf_counter() - t)
            assert sum(map(len, back.values())) == nbytes
            del back
            t = time.perf_counter()
            for name, data in files.items():
                client.upload_fileobj(io.BytesIO(data), args.bucket,
                                      f"bench-boto3/{r}/{name}", Config=transfer)
            b_save.append(time.perf_counter() - t)
            t = time.perf_counter()
            for name in files:
                buf = io.BytesIO()
                client.download_fileobj(args.bucket, f"bench-boto3/{r}/{name}", buf,
                                        Config=transfer)
            b_load.append(time.perf_counter() - t)
            store.delete(f"checkpoints/{r + 1:08d}")
            if r == 0:
                save, load, b_save, b_load = [], [], [], []
    finally:
        if server is not None:
            server.stop()

    med = statistics.median
    mb = nbytes / 1e6
    out = {
        "checkpoint_bytes": nbytes,
        "files": {k: len(v) for k, v in files.items()},
        "model": {"hidden": args.hidden, "layers": args.layers,
                  "intermediate": args.intermediate},
        "repeats": args.repeats,
        "endpoint": "seaweedfs weed mini (loopback)" if server else endpoint,
        "save_s": med(save), "load_s": med(load),
        "save_MBps": mb / med(save), "load_MBps": mb / med(load),
        "boto3_save_s": med(b_save), "boto3_load_s": med(b_load),
        "boto3_save_MBps": mb / med(b_save), "boto3_load_MBps": mb / med(b_load),
        "save_ratio_vs_boto3": med(b_save) / med(save),
        "load_ratio_vs_boto3": med(b_load) / med(load),
        "all_save_s": save, "all_load_s": load, "all_boto3_save_s": b_save,
        "all_boto3_load_s": b_load, "build_s": build_s,
        "cpu_count": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"checkpoint_s3: {mb:.0f} MB save {out['save_MBps']:.0f} MB/s (boto3 "
          f"{out['boto3_save_MBps']:.0f} MB/s, save_ratio_vs_boto3 "
          f"{out['save_ratio_vs_boto3']:.2f}) load {out['load_MBps']:.0f} MB/s (boto3 "
          f"{out['boto3_load_MBps']:.0f} MB/s) -> {args.out}")


if __name__ == "__main__":
    main()
