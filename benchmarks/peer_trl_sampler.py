"""TRL 1.16's generation path samples given prompts (the peer side of agentic_sampler_check.py).

Runs in the peer venv (`make peer`). Builds `GRPOTrainer` with the very settings of
agentic_vs_trl.py (`peer_trl_agentic.grpo_config`), then samples through the comparison's
`TRLGenerate` (TRL's transformers `generate` under its `generation_config`, the task's token
bag as a logits processor, the stop string and rollart's per-row finish rule), `counts[i]`
answers to prompt i, `max_batch_size` rows per generate call as the comparison's turns reach
it. `--data` (written by the benchmark): {match, prompts, counts}. Writes `--out` (JSON):
the answers per prompt and the generation config TRL used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rollart's pure modules

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from benchmarks.agentic_episodes import Match, sampling  # noqa: E402
from benchmarks.peer_trl_agentic import (  # noqa: E402
    TRLGenerate,
    env_outcome_reward,
    grpo_config,
    opening,
)
from rollart.types import GenerationRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = json.loads(Path(a.data).read_text())
    m = Match.from_json(data["match"])
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = [{"prompt": opening("", "", 0)}] * (m.groups * m.group_size)  # never trained on
    trainer = GRPOTrainer(model=model, reward_funcs=env_outcome_reward,
                          args=grpo_config(m, a.seed, str(Path(a.out).parent / "trl-out")),
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          rollout_func=lambda prompts, trainer: {})
    generate = TRLGenerate(trainer, tok, m)  # seeded by the trainer (transformers' set_seed)
    params = sampling(m, tok)["guess"]
    reqs = [GenerationRequest(f"p{i}/s{j}", p, params)
            for i, (p, n) in enumerate(zip(data["prompts"], data["counts"], strict=True))
            for j in range(n)]
    answers: list[list[list[int]]] = [[] for _ in data["prompts"]]
    for c in generate(reqs):
        answers[int(c.request_id.split("/")[0][1:])].append(list(c.token_ids))
    Path(a.out).write_text(json.dumps({
        "answers": answers, "generate_s": generate.generate_s,
        "generation_config": {k: str(v) for k, v in trainer.generation_config.to_dict().items()
                              if not k.startswith("_")}}))


if __name__ == "__main__":
    main()
