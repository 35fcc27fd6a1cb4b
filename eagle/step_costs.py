"""The policy's costs, measured on this machine: a plain and a speculative step of the decode loop, timed.

``measure_policy`` times synthetic steps of a ``BatchDecoder`` (the forwards a real step runs, at a
128-token context, on the loop's own caches and compiled functions) at a few batch sizes and returns a live
``SpeculationPolicy`` over them; the policy then corrects them by the step times requests see
(``SpeculationPolicy.observe_step``).

Owns: ``measure_policy`` and the synthetic steps. Does not own: the rule that decides from the costs
(``eagle.policy``), the step (``eagle.batch``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from eagle.policy import SpeculationPolicy
from eagle.runtime import step_inputs

if TYPE_CHECKING:
    from eagle.batch import BatchDecoder


def synthetic_context(loop: BatchDecoder) -> int:
    """The committed length the synthetic steps run at."""
    return min(128, loop.max_context // 2)


def synthetic_verify(loop: BatchDecoder, batch: int, width: int) -> None:
    """One target forward of ``batch`` rows of ``width`` tokens over rows ``0..batch-1`` of the loop's cache."""
    ids, positions, slots, mask = step_inputs(width, synthetic_context(loop), loop.target.device)
    rows = lambda t: t.expand(batch, *t.shape[1:]).contiguous()  # noqa: E731
    loop.target_rows(rows(ids), rows(positions), rows(slots[None]), rows(mask))


def synthetic_draft(loop: BatchDecoder, batch: int) -> None:
    """A catch-up of the compiled width, then the tree drafted from its last output, for ``batch`` rows."""
    heads, context = loop.heads, synthetic_context(loop)
    device, dtype = loop.target.device, loop.runtime.model.lm_head.weight.dtype
    width = loop.decoder._widths()["advance"][0]
    features = torch.zeros(1, width, heads.lean.input_size, dtype=dtype, device=device)
    ids, positions, slots, mask = step_inputs(width, context, device)
    if loop.single(batch):
        view = loop.head_cache.row(0)
        hidden = heads.advance(width)(features, ids, positions, slots, mask, view.keys, view.values)[:, -1]
    else:
        rows = lambda t: t.expand(batch, *t.shape[1:]).contiguous()  # noqa: E731
        hidden = heads.rows_lean(rows(features), rows(ids), rows(positions), rows(slots[None]), rows(mask),
                                 loop.head_cache.keys, loop.head_cache.values)[:, -1]
    roots = torch.zeros(batch, dtype=torch.long, device=device)
    prefix = torch.full((batch,), context, dtype=torch.long, device=device)
    loop.draft_rows(hidden, roots, prefix, [[0] * 4] * batch)


def time_step(loop: BatchDecoder, batch: int, speculative: bool, repeats: int) -> float:
    """Milliseconds of one synthetic step of ``batch`` rows (the median of ``repeats``): catch-up, drafting
    and the tree's verification, or one plain verification."""
    times = []
    for _ in range(repeats + 1):  # the first call warms (compiles) and is not counted
        started = time.perf_counter()
        if speculative:
            synthetic_draft(loop, batch)
        synthetic_verify(loop, batch, loop.verify_width(speculative))
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]


@torch.inference_mode()
def measure_policy(loop: BatchDecoder, sizes: Sequence[int] | None = None, repeats: int = 3) -> SpeculationPolicy:
    """A live ``SpeculationPolicy`` over the loop's measured plain and speculative step costs at ``sizes``
    (default 1, 2, 4, ... up to ``max_batch``), keeping the loop's current policy's mode, tau and
    exploration settings.

    Speculative steps are measured up to the first batch size whose break-even passes the most tokens a
    step can yield per row (the tree's depth + 1): verification only grows more compute-bound with the
    batch, so drafting cannot pay at the larger sizes either, and ``SpeculationPolicy`` extrapolates their
    cost. Where drafting is dear (bf16 emulated on an AVX2 CPU: a SmolLM2 speculative step 13x a plain one
    at batch 1) this skips the slowest measurements of a replica's start."""
    sizes = sorted(set(sizes or [b for b in (1, 2, 4, 8, 16, 32) if b < loop.max_batch] + [loop.max_batch]))
    plain, speculative = {}, {}
    most_per_step = loop.decoder.tree.depth + 1 if loop.heads is not None else 0
    for batch in sizes:
        plain[batch] = time_step(loop, batch, False, repeats)
        if loop.heads is not None and all(speculative[b] <= most_per_step * plain[b] for b in speculative):
            speculative[batch] = time_step(loop, batch, True, repeats)
    current = loop.policy
    return SpeculationPolicy(plain, speculative, mode=loop.speculate, prior_tau=current.tau,
                             explore_every=current.explore_every, explore_backoff=current.explore_backoff, live=True)
