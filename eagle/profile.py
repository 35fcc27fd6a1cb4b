"""Micro-timings that size the draft tree: one target forward over N tree tokens, one draft step.

On a CPU the verification forward's cost grows with the tree and the draft's cost is dominated by the LM
head over the draft vocabulary, so these two numbers decide which tree sizes can pay off.
Does not own: end-to-end speed (``bench.py``).
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from typing import Sequence

import torch

from eagle.head import EagleHead
from eagle.target import Target, crop_cache, load_target
from eagle.tree import additive_mask, causal_mask

logger = logging.getLogger(__name__)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


@torch.inference_mode()
def profile_forward(
    target: str | Target,
    *,
    dtype: str = "float32",
    sizes: Sequence[int] = (1, 8, 16, 32, 64),
    context: int = 256,
    repeats: int = 10,
    draft_vocabs: Sequence[int] = (),
    draft_width: int = 4,
) -> dict:
    """Median milliseconds of a target forward over each tree size after ``context`` cached tokens, and of
    one draft step (head forward over ``draft_width`` nodes + draft LM head) for each draft vocabulary."""
    if isinstance(target, str):
        target = load_target(target, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, context), generator=generator)
    cache = target.new_cache()
    features = target.forward(prompt, cache)
    result: dict = {
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "context": context,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "target_forward_ms": {},
        "target_forward_with_lm_head_ms": {},
        "draft_step_ms": {},
    }
    for size in sizes:
        ids = torch.randint(0, target.vocab_size, (1, size), generator=generator)
        positions = torch.arange(context, context + size).unsqueeze(0)
        mask = causal_mask(size, context, target.dtype) if size > 1 else None

        def forward(with_head: bool = False):
            out = target.forward(ids, cache, positions, mask)
            if with_head:
                target.logits(out[0])
            crop_cache(cache, context)

        result["target_forward_ms"][size] = round(_median_ms(forward, repeats), 2)
        result["target_forward_with_lm_head_ms"][size] = round(_median_ms(lambda: forward(True), repeats), 2)
        logger.info("target forward over %d tokens: %.1f ms", size, result["target_forward_ms"][size])

    for vocab in list(draft_vocabs) or [target.vocab_size]:
        draft_ids = None if vocab >= target.vocab_size else torch.arange(vocab)
        head = EagleHead.for_target(target, seed=0, draft_token_ids=draft_ids)
        head_cache = head.new_cache()
        positions = torch.arange(context).unsqueeze(0)
        head(features, prompt, head_cache, positions, causal_mask(context, 0, target.dtype))
        width_features = features[:, -draft_width:]
        width_ids = prompt[:, -draft_width:]
        step_positions = torch.full((1, draft_width), context)
        step_mask = additive_mask(torch.ones(draft_width, context + draft_width, dtype=torch.bool), target.dtype)

        def draft_step():
            hidden = head(width_features, width_ids, head_cache, step_positions, step_mask)
            torch.log_softmax(head.draft_logits(hidden[0]), dim=-1).topk(draft_width, dim=-1)
            crop_cache(head_cache, context)

        result["draft_step_ms"][vocab] = round(_median_ms(draft_step, repeats), 2)
        logger.info("draft step (%d nodes, vocab %d): %.1f ms", draft_width, vocab, result["draft_step_ms"][vocab])
    return result
