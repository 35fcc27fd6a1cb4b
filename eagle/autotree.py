"""``--tree auto``: the dynamic tree that maximises expected tokens per second on this machine, for this head.

EAGLE-2 (arXiv 2406.16858) fixes depth, top-k and the number of verified tokens by hand; its reference
code's ``total_token=-1`` sizes the tree by timing forwards at start-up. Here both halves of the trade-off
are measured when a decoder starts:

* **acceptance** — a calibration decode (greedy, eager, the prompts batched) with the widest candidate
  tree: depth ``max_depth``, top-k ``max(top_ks)``, every drafted node verified. For a smaller
  configuration (depth d, top-k k, size T) the tree it would draft is, node for node, a subset of the
  candidates drafted here (a node's predicted feature depends only on its ancestors, so the head computes
  the same values); where the smaller tree would expand a node the wide one did not, that node's children
  are unknown and counted as rejected (the estimate errs low). Greedy acceptance follows the target's
  argmax chain, which the wide tree's accepted path holds as far as it reaches, so the smaller tree
  accepts the prefix of that path it contains. The estimate is of greedy acceptance at any temperature.
* **cost** — the decoder's own functions timed at every candidate width after a 256-token context
  (compiled under ``compile="on"``): the target's step at 1 + T, the head's draft step at k, its
  catch-up, the first proposal. Target step timings are cached per machine, target revision, dtype and
  compile settings (``$EAGLE_CACHE_DIR/autotree``), since compiling every width is the slow part.

Expected throughput = tau / (propose + (d - 1) x expand(k) + verify(1 + T) + advance); the best wins.
Owns: ``choose_tree``. Does not own: drafting (``tree.py``) or timing helpers (``profile.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from eagle.batch import BatchDecoder
from eagle.request import GenerationConfig
from eagle.tree import AutoTree, DynamicTree

if TYPE_CHECKING:
    from eagle.generate import Decoder

logger = logging.getLogger(__name__)

CALIBRATION_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when its lookups become slow.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists.\"\"\"",
    "What are three practical ways to reduce the energy use of a home? Answer as a numbered list.",
    "Translate into French: The meeting was moved to Thursday because the room was not available.",
    "A train leaves at 9:40 and arrives at 13:15. How long is the journey? Show your reasoning.",
)
CALIBRATION_TOKENS = 48
COST_CONTEXT = 256
COST_REPEATS = 5
_TIE = 1e-9  # the reranking key of eagle.tree.draft_trees


def _prompts(decoder: "Decoder") -> list[list[int]]:
    target = decoder.target
    if target.tokenizer is not None:
        chat = bool(getattr(target.tokenizer, "chat_template", None))
        return [target.encode(text, chat=chat) for text in CALIBRATION_PROMPTS]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, target.vocab_size, (12,), generator=generator).tolist() for _ in CALIBRATION_PROMPTS]


def _calibrate(decoder: "Decoder", spec: AutoTree) -> list[dict]:
    """Per step of the wide calibration decode: candidates (parent, depth, rank, score) and the accepted path.

    The prompts decode together, greedily and eagerly, as one batch that drafts every step
    (``BatchDecoder`` with ``speculate="always"``); ``BatchDecoder.trace`` hands over each row's tree and
    the nodes it kept."""
    k = max(spec.top_ks)
    wide = DynamicTree(depth=spec.max_depth, top_k=k, total_tokens=k + (spec.max_depth - 1) * k * k)
    calibration = type(decoder)(decoder.target, decoder.head, wide, compile="off")
    config = GenerationConfig(max_new_tokens=CALIBRATION_TOKENS, stop_token_ids=[])
    prompts = [p for p in _prompts(decoder) if len(p) + CALIBRATION_TOKENS + wide.size + 1 <= calibration.context_window]
    if not prompts:
        return []
    engine = BatchDecoder(calibration, max_batch=len(prompts), max_context=max(map(len, prompts)) + CALIBRATION_TOKENS,
                          speculate="always")
    steps: list[dict] = []

    def record(trees, keeps) -> None:
        for tree, keep in zip(trees, keeps):
            _, parents = tree.host
            rank, seen = [0] * len(parents), {}
            for node in range(1, len(parents)):
                rank[node] = seen.get(parents[node], 0)
                seen[parents[node]] = rank[node] + 1
            steps.append({"parents": parents, "depths": tree.depths.tolist(), "ranks": rank, "scores": tree.scores.tolist(), "path": keep[1:]})

    engine.trace = record
    for prompt in prompts:
        engine.submit(prompt, config)
    engine.run_until_done()
    return steps


def _accepted(step: dict, depth: int, k: int, size: int) -> int:
    """Tokens a (depth, k, size) dynamic tree would have accepted at this step (see the module docstring)."""
    parents, depths, ranks, scores = step["parents"], step["depths"], step["ranks"], step["scores"]
    children: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(parents[node], []).append(node)
    expanded, candidates = [0], []
    for level in range(1, depth + 1):
        level_nodes = [c for e in expanded for c in children.get(e, []) if ranks[c] < k]
        candidates += level_nodes
        expanded = sorted(level_nodes, key=lambda n: -scores[n])[:k]
    kept = set(sorted(candidates, key=lambda n: -(scores[n] - _TIE * depths[n]))[:size])
    accepted = 0
    for node in step["path"]:
        if node not in kept:
            break
        accepted += 1
    return accepted


def _cache_file(decoder: "Decoder"):
    from eagle.profile import machine
    from eagle.target import cache_root

    key = {
        "target": decoder.target.name, "revision": decoder.target.revision, "dtype": str(decoder.target.dtype),
        "device": str(decoder.target.device), "compile": asdict(decoder.compile), **machine(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "autotree" / f"verify-{digest}.json", key


def _verify_costs(decoder: "Decoder", widths: list[int]) -> dict[int, float]:
    """Milliseconds of the target's step per width, from the cache or measured (and cached)."""
    from eagle.profile import time_ms
    from eagle.runtime import step_inputs

    path, key = _cache_file(decoder)
    cached: dict[int, float] = {}
    if path.is_file():
        try:
            cached = {int(w): float(ms) for w, ms in json.loads(path.read_text())["verify_ms"].items()}
        except (ValueError, KeyError, json.JSONDecodeError):
            cached = {}
    missing = [w for w in widths if w not in cached]
    if missing:
        runtime = decoder.runtime
        cache = runtime.new_cache(decoder._capacity(COST_CONTEXT, scratch=max(missing)))
        generator = torch.Generator().manual_seed(0)
        runtime.prefill(torch.randint(0, decoder.target.vocab_size, (COST_CONTEXT,), generator=generator).to(decoder.target.device), cache)
        for width in missing:
            step = runtime.step(width)
            inputs = step_inputs(width, COST_CONTEXT, decoder.target.device)
            cached[width] = time_ms(lambda: step(*inputs, cache.keys, cache.values), COST_REPEATS)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.time_ns()}.tmp")
        tmp.write_text(json.dumps({"key": key, "verify_ms": cached}, indent=2, sort_keys=True))
        tmp.replace(path)
    return {w: cached[w] for w in widths}


def _head_costs(decoder: "Decoder", spec: AutoTree) -> dict[str, float | dict[int, float]]:
    from eagle.profile import time_ms
    from eagle.runtime import step_inputs

    device = decoder.target.device
    heads = decoder.head_runtime
    dtype = decoder.runtime.model.lm_head.weight.dtype
    cache = heads.new_cache(decoder._capacity(COST_CONTEXT, scratch=(spec.max_depth + 1) * max(spec.top_ks)))
    hidden = torch.zeros(1, decoder.target.hidden_size, dtype=dtype, device=device)
    costs: dict = {"propose": time_ms(lambda: heads.lean.propose(hidden, max(spec.top_ks)), COST_REPEATS), "expand": {}}
    for k in spec.top_ks:
        args = (torch.zeros(1, k, decoder.target.hidden_size, dtype=dtype, device=device), *step_inputs(k, COST_CONTEXT, device))
        expand = heads.expand(k)
        costs["expand"][k] = time_ms(lambda: expand(*args, cache.keys, cache.values, k), COST_REPEATS)
    width = spec.max_depth + 1
    args = (torch.zeros(1, width, heads.lean.input_size, dtype=dtype, device=device), *step_inputs(width, COST_CONTEXT, device))
    advance = heads.advance(width)
    costs["advance"] = time_ms(lambda: advance(*args, cache.keys, cache.values), COST_REPEATS)
    return costs


@torch.inference_mode()
def choose_tree(decoder: "Decoder", spec: AutoTree) -> tuple[DynamicTree, dict]:
    """The measured best ``DynamicTree`` within ``spec``'s bounds, and a report of what was measured."""
    started = time.perf_counter()
    steps = _calibrate(decoder, spec)
    configs = [
        (d, k, t) for d in range(1, spec.max_depth + 1) for k in spec.top_ks for t in spec.sizes
        if t <= k + (d - 1) * k * k
    ]
    verify = _verify_costs(decoder, sorted({1 + t for _, _, t in configs} | {1}))
    head = _head_costs(decoder, spec)
    rows = []
    for d, k, t in configs:
        tau = 1 + sum(_accepted(step, d, k, t) for step in steps) / max(1, len(steps))
        cost = head["propose"] + (d - 1) * head["expand"][k] + verify[1 + t] + head["advance"]
        rows.append({"depth": d, "top_k": k, "total_tokens": t, "tau": round(tau, 3), "step_ms": round(cost, 2), "tokens_per_s": round(1000 * tau / cost, 1)})
    rows.sort(key=lambda r: -r["tokens_per_s"])
    best = rows[0]
    chosen = DynamicTree(depth=best["depth"], top_k=best["top_k"], total_tokens=best["total_tokens"])
    plain = 1000 / verify[1]
    report = {
        "chosen": asdict(chosen),
        "expected_tau": best["tau"],
        "expected_tokens_per_s": best["tokens_per_s"],
        "plain_tokens_per_s": round(plain, 1),
        "calibration_steps": len(steps),
        "verify_ms": {str(w): round(ms, 2) for w, ms in verify.items()},
        "head_ms": {"propose": round(head["propose"], 2), "advance": round(head["advance"], 2), "expand": {str(k): round(v, 2) for k, v in head["expand"].items()}},
        "candidates": rows[:10],
        "measure_s": round(time.perf_counter() - started, 1),
    }
    report["summary"] = (
        f"depth {chosen.depth}, top-k {chosen.top_k}, {chosen.total_tokens} tokens: expected tau {best['tau']:.2f}, "
        f"{best['tokens_per_s']:.1f} tok/s vs plain {plain:.1f} (measured in {report['measure_s']:.0f} s over {len(steps)} steps)"
    )
    logger.info("auto tree: %s", report["summary"])
    if best["tokens_per_s"] < plain:
        logger.warning("auto tree: no tree beats plain decoding with this head on this machine (expected %.1f vs %.1f tok/s); "
                       "--head none would be faster", best["tokens_per_s"], plain)
    return chosen, report
