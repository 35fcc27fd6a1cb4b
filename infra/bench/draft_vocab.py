"""How much of what the target says a reduced draft vocabulary can draft, per size (docs/benchmarks.md).

A token outside the draft vocabulary is never proposed, so every position where the target emits one ends
the accepted run there. For each size V, the draft vocabulary is built as the training job builds it
(``eagle.head.draft_vocab_from_counts``: the V most frequent answer tokens, stop tokens always kept) from
two corpora:

* ``regenerated``: the target's own greedy answers to ``--regen-prompts`` ShareGPT first turns (what the
  presets that regenerate count), made with the batch decoder as ``jobs.prepare_data`` makes them;
* ``sharegpt``: the original answers of ``--conversations`` ShareGPT conversations (tokenised with the chat
  template; what a preset without regeneration counts);

and measured on the target's greedy answers to MT-bench first turns (``--mtbench`` prompts spread over the 8
categories, ``--max-new-tokens`` each): the share of answer tokens inside the vocabulary.

    .venv/bin/python infra/bench/draft_vocab.py --out docs/bench/draft-vocab/draft-vocab.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from eagle.bench import prompt_set
from eagle.data import load_sharegpt, tokenize
from eagle.head import draft_vocab_from_counts
from eagle.profile import machine
from eagle.runtime import preferred_dtype, use_threads
from eagle.target import load_target
from jobs.prepare_data import chat_prompt, generate_answers

logger = logging.getLogger("draft_vocab")
SIZES = (4096, 8192, 16384, 32768)


def coverage(counts: torch.Tensor, answers: list[list[int]], sizes, always) -> dict[int, float]:
    tokens = torch.tensor([t for answer in answers for t in answer], dtype=torch.long)
    out = {}
    for size in sizes:
        inside = torch.zeros(counts.numel(), dtype=torch.bool)
        inside[draft_vocab_from_counts(counts, size, always=always)] = True
        out[size] = round(float(inside[tokens].float().mean()), 4)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--regen-prompts", type=int, default=256)
    parser.add_argument("--regen-max-new-tokens", type=int, default=192)
    parser.add_argument("--mtbench", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=640)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = use_threads(None)
    dtype = preferred_dtype("auto")
    target = load_target("smollm2-135m", dtype=dtype)
    vocab, always = target.vocab_size, target.eos_token_ids
    started = time.perf_counter()

    conversations = load_sharegpt(limit=args.conversations)
    sharegpt = torch.zeros(vocab, dtype=torch.int64)
    for conversation in conversations:
        record = tokenize(target.tokenizer, conversation, max_length=args.max_length)
        ids, mask = torch.as_tensor(record.input_ids), torch.as_tensor(record.loss_mask).bool()
        sharegpt += torch.bincount(ids[mask].long(), minlength=vocab)[:vocab]
    logger.info("ShareGPT answers: %d tokens from %d conversations", int(sharegpt.sum()), len(conversations))

    firsts = [c for c in load_sharegpt(limit=4 * args.regen_prompts) if c.turns and c.turns[0][0] == "user"]
    prompts = [chat_prompt(target.tokenizer, [{"role": "user", "content": c.turns[0][1]}]) for c in firsts]
    prompts = [p for p in prompts if len(p) < args.max_length][: args.regen_prompts]
    answers = generate_answers(target, prompts, max_new_tokens=args.regen_max_new_tokens, batch_size=64, max_length=args.max_length, engine="eagle")
    regenerated = torch.zeros(vocab, dtype=torch.int64)
    for answer in answers:
        regenerated += torch.bincount(torch.tensor(answer, dtype=torch.long), minlength=vocab)[:vocab]
    logger.info("regenerated answers: %d tokens from %d prompts", int(regenerated.sum()), len(prompts))

    mtbench = prompt_set("mtbench", target, args.mtbench)
    replies = generate_answers(target, [p.token_ids for p in mtbench], max_new_tokens=args.max_new_tokens, batch_size=len(mtbench), engine="eagle")
    logger.info("MT-bench: %d answer tokens from %d prompts", sum(len(r) for r in replies), len(replies))

    sizes = [s for s in SIZES if s < vocab] + [vocab]
    result = {
        "command": "infra/bench/draft_vocab.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": {**machine(), "threads": threads}, "dtype": dtype, "target_vocab": vocab,
        "corpora": {"sharegpt_answer_tokens": int(sharegpt.sum()), "regenerated_answer_tokens": int(regenerated.sum()),
                    "mtbench_answer_tokens": sum(len(r) for r in replies), "mtbench_prompts": len(replies)},
        "mtbench_coverage": {
            "regenerated": coverage(regenerated, replies, sizes, always),
            "sharegpt": coverage(sharegpt, replies, sizes, always),
        },
        "distinct_tokens": {"regenerated": int((regenerated > 0).sum()), "sharegpt": int((sharegpt > 0).sum()),
                            "mtbench": len({t for r in replies for t in r})},
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    logger.info("MT-bench coverage: %s", result["mtbench_coverage"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
