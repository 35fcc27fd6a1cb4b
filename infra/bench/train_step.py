"""What one training step of a head costs, per head kind, draft vocabulary and training-time-test depth.

    .venv/bin/python infra/bench/train_step.py --out docs/bench/train_step.json

SmolLM2-135M's embedding and LM head (bf16 autocast, fp32 master weights, as the training job runs), one
rank, a batch of ``--tokens`` tokens (8 records), random features (the cost does not depend on their values).
Each record's first tokens are its prompt and the rest its answer (``--assistant-fractions``; the loss counts
answer tokens only, and computes the LM-head logits only there, so a fraction of 1.0 costs what computing
every position did). Each row: milliseconds per step (forward, backward, AdamW), tokens and answer tokens per
second; plus the cost of the target's distribution over the draft rows, which the loss computes once per step
(it once did so at every depth of the training-time test).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle.head import EagleHead, draft_vocab_from_counts
from eagle.loss import LossConfig
from eagle.profile import machine
from eagle.target import load_target
from eagle.train import Batch, build_optimizer, train_step


def _batch(target, head, tokens: int, records: int, answer_fraction: float) -> Batch:
    n = tokens // records
    generator = torch.Generator().manual_seed(0)
    # tokens from the draft vocabulary: an EAGLE-3 loss skips the positions whose token lies outside it, and a
    # real corpus's answers lie inside for all but a few percent (infra/bench/draft_vocab.py)
    vocab = head.draft_to_target(torch.arange(head.config.draft_vocab_size or target.vocab_size))
    ids = vocab[torch.randint(0, vocab.numel(), (records, n), generator=generator)]
    features = torch.randn(records, n, target.hidden_size, generator=generator)
    aux = torch.randn(records, n, head.config.input_size, generator=generator) if head.eagle3 else None
    mask = torch.zeros_like(ids)
    mask[:, n - round(n * answer_fraction) :] = 1
    return Batch(ids, mask, features, aux)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--assistant-fractions", type=float, nargs="+", default=[1.0, 0.73],
        help="answer share of each record's tokens (0.73: the quick preset's data, 114k of 156k tokens)",
    )
    parser.add_argument("--vocab", type=int, nargs="+", default=[16384, 8192])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = load_target("smollm2-135m", dtype="float32")
    target.model.requires_grad_(False)
    counts = torch.arange(target.vocab_size, 0, -1)  # any ranking: the cost depends on the size only
    rows = []
    for kind, depth in (("eagle1", 1), ("eagle1", 2), ("eagle3", 3), ("eagle3", 7)):
        for vocab in args.vocab:
            ids = draft_vocab_from_counts(counts, vocab)
            head = EagleHead.for_target(target, seed=0, draft_token_ids=ids, kind=kind, fc_bias=False, input_norm=kind == "eagle3")
            optimizer = build_optimizer(head, lr=1e-4)
            config = LossConfig.for_kind(kind, depth=depth)
            for fraction in args.assistant_fractions:
                batch = _batch(target, head, args.tokens, 8, fraction)
                step_ms = _time(lambda: train_step(head, optimizer, batch, config, autocast_bf16=True), args.repeats)
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    p_ms = _time(lambda: torch.softmax(head.target_logits(batch.features), -1), args.repeats)
                answer = int(batch.loss_mask.sum())
                rows.append({
                    "kind": kind, "depth": depth, "draft_vocab": vocab, "assistant_fraction": fraction, "step_ms": round(step_ms, 1),
                    "tokens_per_s": round(args.tokens / step_ms * 1e3, 1), "answer_tokens_per_s": round(answer / step_ms * 1e3, 1),
                    "target_distribution_all_positions_ms": round(p_ms, 1), "saved_by_computing_it_once_ms": round(p_ms * (depth - 1), 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    result = {"machine": machine(), "tokens": args.tokens, "threads": torch.get_num_threads(), "rows": rows}
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
