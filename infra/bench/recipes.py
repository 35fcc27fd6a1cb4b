"""Head training recipes side by side at an equal wall-clock budget, on one feature dump, in one process.

    .venv/bin/python infra/bench/recipes.py --dataset sharegpt-regen-6144 --minutes 8 \
        --recipe base --recipe 'tok1:w_token=1.0' --out docs/bench/recipes/recipes.json

A recipe is ``name[:key=value,...]`` over ``w_feature``, ``w_token``, ``noise``, ``depth``, ``ce_fraction``
(eagle.loss.LossConfig), ``lr``, ``warmup``, ``draft_vocab`` (its size), ``layers`` (decoder layers in the head, for screening only: the
head's save and export formats hold one) and ``init_layer`` (copy the target's decoder layer of that index into the head's layer
before training; -1 = the last). Every recipe trains an ``eagle1`` head from the same seed on the same
record order with the training job's optimizer, learning-rate schedule (``jobs.train_head.learning_rate``,
decaying over ``--minutes``), bf16 autocast where the CPU has native bf16, and batches of ``--batch-tokens``;
each reports held-out simulated tau (chain of 5, against the target's own greedy choices, as the training
job's evaluation) at every ``--eval-every`` minutes of step time. This is a screening tool: the training
job (Ray Train + DeepSpeed) is what the presets run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

import torch

from eagle.head import EagleHead
from eagle.loss import LossConfig, rollout_metrics, target_greedy
from eagle.profile import machine
from eagle.runtime import native_bf16, use_threads
from eagle.target import adapter_for, load_target, resolve_target
from eagle.train import build_optimizer, collate, compute_loss, token_budget_batches
from jobs import layout
from jobs.common import default_storage
from jobs.presets import TrainConfig
from jobs.train_head import Progress, _draft_vocab, learning_rate

logger = logging.getLogger("recipes")

LOSS_KEYS = ("w_feature", "w_token", "noise", "depth", "ce_fraction")


def parse_recipe(text: str) -> tuple[str, dict[str, float]]:
    name, _, rest = text.partition(":")
    values = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in (*LOSS_KEYS, "lr", "warmup", "init_layer", "draft_vocab", "layers"):
            raise SystemExit(f"unknown recipe key {key!r}")
        values[key] = float(value)
    return name, values


def run_recipe(name, values, *, target, storage, records, eval_batch, greedy, args) -> dict:
    base = TrainConfig(lr=args.lr, warmup_steps=args.warmup, max_minutes=args.minutes, batch_tokens=args.batch_tokens)
    train = dataclasses.replace(base, lr=values.get("lr", base.lr), warmup_steps=int(values.get("warmup", base.warmup_steps)))
    overrides = {"depth": args.depth, **{k: values[k] for k in LOSS_KEYS if k in values}}
    loss_config = LossConfig.for_kind("eagle1", **{**overrides, "depth": int(overrides["depth"])})
    head = EagleHead.for_target(
        target, seed=0, draft_token_ids=_draft_vocab(storage, target, int(values.get("draft_vocab", args.draft_vocab_size))), fc_bias=False, input_norm=False,
    ).to(torch.float32)
    for index in range(1, int(values.get("layers", 1))):  # screening only: the head's save and export formats hold one layer
        layer_config = head.config.transformers_config()
        extra = adapter_for(layer_config).decoder_layer_cls()(layer_config, layer_idx=index).to(torch.float32)
        head.layers.append(extra)  # keeps its input norm: it reads the first layer's output, not fc's
    if "init_layer" in values:
        index = int(values["init_layer"])
        source = target.backbone.layers[index].state_dict()
        missing = head.layers[0].load_state_dict({k: v.float() for k, v in source.items() if not k.startswith("input_layernorm")}, strict=False)
        logger.info("%s: head layer from target layer %d (missing %s)", name, index, missing.missing_keys)
    optimizer = build_optimizer(head, lr=train.lr, betas=train.betas)
    lengths = [int(r["input_ids"].shape[0]) for r in records]
    autocast = native_bf16()
    progress, curve, next_eval, epoch = Progress(), [], 0.0, 0
    total_steps = 10**9  # the deadline ends the run, as max_minutes does in the job

    def evaluate():
        head.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            metrics = rollout_metrics(head, eval_batch.features, eval_batch.input_ids, eval_batch.loss_mask, 5, greedy=greedy)
        head.train()
        point = {"minutes": round(progress.elapsed_s / 60, 2), "step": progress.step, "sim_tau": round(metrics["sim_tau"], 4),
                 "acc": [round(metrics[f"acc_{k}"], 4) for k in range(1, 6)]}
        logger.info("%s: %s", name, point)
        curve.append(point)

    head.train()
    while progress.elapsed_s < args.minutes * 60:
        for batch_ids in token_budget_batches(lengths, train.batch_tokens, seed=0, epoch=epoch):
            if progress.elapsed_s >= next_eval * 60:
                evaluate()
                next_eval += args.eval_every
            if progress.elapsed_s >= args.minutes * 60:
                break
            started = time.perf_counter()
            batch = collate([records[i] for i in batch_ids]).to("cpu", None if autocast else torch.float32)
            lr = learning_rate(train, progress, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss, _ = compute_loss(head, batch, loss_config, autocast_bf16=autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), train.clip)
            optimizer.step()
            progress.step += 1
            progress.elapsed_s += time.perf_counter() - started
        epoch += 1
    if curve[-1]["step"] != progress.step:
        evaluate()
    per_epoch = len(token_budget_batches(lengths, train.batch_tokens, seed=0, epoch=0))
    return {"recipe": name, "values": values, "loss": dataclasses.asdict(loss_config), "lr": train.lr, "steps": progress.step,
            "epochs": round(progress.step / per_epoch, 2), "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--recipe", action="append", required=True)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--eval-records", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    use_threads(args.threads)
    _, target_name, _ = resolve_target(args.target)
    storage = layout.dataset_storage(args.storage or default_storage(), target_name, args.dataset)
    target = load_target(args.target, dtype="bfloat16" if native_bf16() else "float32")
    records = layout.load_records(storage, layout.FEATURES, "train")
    eval_batch = collate(layout.load_records(storage, layout.FEATURES, "eval")[: args.eval_records])
    greedy = target_greedy(target, eval_batch.features)
    if not native_bf16():
        eval_batch = eval_batch.to("cpu", torch.float32)
    results = []
    for text in args.recipe:
        name, values = parse_recipe(text)
        results.append(run_recipe(name, values, target=target, storage=storage, records=records, eval_batch=eval_batch, greedy=greedy, args=args))
        with open(args.out, "w") as handle:
            json.dump({"machine": machine(), "args": vars(args), "records": len(records), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
