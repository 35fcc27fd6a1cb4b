"""The fast path's runtime: a target's and a head's lean modules and their compiled functions by width.

A ``TargetRuntime`` is built once per (target, compile settings) and shared by every ``Decoder`` on that
target (plain decoding, EAGLE, a hot-swapped head), so the target's graphs compile once per process. A
``HeadRuntime`` is built once per head. Both hand out ``CompiledFunction``s keyed by width; prefills (one
per request, prompt-length wide) run eagerly.

Does not own: the decode loop (``generate.py``) or compile settings (``compile.py``).
"""

from __future__ import annotations

import torch

from eagle.compile import CompileConfig, CompiledFunction
from eagle.head import EagleHead, LeanHead
from eagle.model import KVCache, LeanModel
from eagle.target import Target
from eagle.tree import causal_allowed, padded_mask

ROPE_TABLE_LIMIT = 1 << 15  # positions tabulated for the rotary embedding (the decoder's context cap)
# step(input_ids, positions, slots, mask, keys, values): the KV length (mask dim 3) and the capacity of every
# cache buffer (dim 2) vary between calls
_STEP_DYNAMIC = {3: 3, 4: 2, 5: 2}
# the head's forward / expand(features, next_tokens, positions, slots, mask, keys, values[, k]): the same dims
_HEAD_DYNAMIC = {4: 3, 5: 2, 6: 2}
# the batched functions (eagle.batch): the batch (dim 0 of every input and of the mask, the cache's rows) too
_STEP_ROWS_DYNAMIC = {0: 0, 1: 0, 2: 0, 3: (0, 3), 4: (0, 2), 5: (0, 2)}
_HEAD_ROWS_DYNAMIC = {0: 0, 1: 0, 2: 0, 3: 0, 4: (0, 3), 5: (0, 2), 6: (0, 2)}


def context_limit(target: Target) -> int:
    return min(target.max_positions, ROPE_TABLE_LIMIT)


@torch.inference_mode()  # inference tensors, as the decoder's own inputs are (the graphs guard on it)
def step_inputs(width: int, start: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids ``[1, w]``, positions ``[1, w]``, slots ``[w]``, mask ``[1, 1, w, start + w]``): ``width`` tokens
    after ``start`` cached ones, each seeing the prefix and itself: the shapes of a step, for warm-up and
    timing."""
    slots = torch.arange(start, start + width, device=device)
    mask = padded_mask(torch.eye(width, dtype=torch.bool, device=device), start, width)
    return torch.zeros(1, width, dtype=torch.long, device=device), slots[None], slots, mask[None, None]


class TargetRuntime:
    """The target's ``LeanModel``, its compiled ``step`` per width, and its eager prefill."""

    def __init__(self, target: Target, compile: CompileConfig) -> None:
        self.target = target
        self.compile = compile
        self.model = LeanModel(target.backbone, target.lm_head, target.config, context_limit(target))
        self._steps: dict[int, CompiledFunction] = {}
        self._step_rows: dict[int, CompiledFunction] = {}

    def step(self, width: int) -> CompiledFunction:
        """``LeanModel.step`` over ``width`` tokens: (features ``[w, h]``, logits ``[w, V]``, greedy ids ``[w]``)."""
        if width not in self._steps:
            self._steps[width] = CompiledFunction(
                (self.model, "step"), f"{self.target.name} step[{width}]", self.compile, self.target.device, _STEP_DYNAMIC
            )
        return self._steps[width]

    def step_rows(self, width: int) -> CompiledFunction:
        """``LeanModel.step_rows`` over a batch of rows ``width`` tokens wide (one graph for every batch size)."""
        if width not in self._step_rows:
            self._step_rows[width] = CompiledFunction(
                (self.model, "step_rows"), f"{self.target.name} step_rows[{width}]", self.compile, self.target.device, _STEP_ROWS_DYNAMIC
            )
        return self._step_rows[width]

    def new_cache(self, capacity: int, rows: int = 1) -> KVCache:
        return self.model.new_cache(capacity, rows)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Features ``[n, hidden]`` of ``prompt`` ``[n]``, written to cache slots ``0..n-1``."""
        n = prompt.numel()
        device = prompt.device
        positions = torch.arange(n, device=device)
        return self.model(prompt[None], positions[None], positions, causal_allowed(n, 0, device)[None, None], cache.keys, cache.values)[0]

    def compile_seconds(self) -> dict[str, float]:
        return {f.name: f.compile_s for f in (*self._steps.values(), *self._step_rows.values()) if f.compile_s is not None}


class HeadRuntime:
    """A head's ``LeanHead``: compiled ``expand`` (one draft step) and ``advance`` (the catch-up over the
    accepted tokens) per width, and the eager prefill."""

    def __init__(self, head: EagleHead, target: Target, compile: CompileConfig) -> None:
        self.lean = LeanHead(head, context_limit(target))
        self.compile = compile
        self.device = target.device
        self.label = f"{target.name} head"
        self._expand: dict[int, CompiledFunction] = {}
        self._advance: dict[int, CompiledFunction] = {}
        self._expand_rows: dict[int, CompiledFunction] = {}
        self._advance_rows: dict[int, CompiledFunction] = {}

    def expand_rows(self, width: int) -> CompiledFunction:
        if width not in self._expand_rows:
            self._expand_rows[width] = CompiledFunction(
                (self.lean, "expand_rows"), f"{self.label} expand_rows[{width}]", self.compile, self.device, _HEAD_ROWS_DYNAMIC
            )
        return self._expand_rows[width]

    def advance_rows(self, width: int) -> CompiledFunction:
        if width not in self._advance_rows:
            self._advance_rows[width] = CompiledFunction(
                (self.lean, "forward"), f"{self.label} advance_rows[{width}]", self.compile, self.device, _HEAD_ROWS_DYNAMIC
            )
        return self._advance_rows[width]

    def expand(self, width: int) -> CompiledFunction:
        if width not in self._expand:
            self._expand[width] = CompiledFunction((self.lean, "expand"), f"{self.label} expand[{width}]", self.compile, self.device, _HEAD_DYNAMIC)
        return self._expand[width]

    def advance(self, width: int) -> CompiledFunction:
        if width not in self._advance:
            self._advance[width] = CompiledFunction((self.lean, "forward"), f"{self.label} advance[{width}]", self.compile, self.device, _HEAD_DYNAMIC)
        return self._advance[width]

    def new_cache(self, capacity: int, rows: int = 1) -> KVCache:
        return self.lean.new_cache(capacity, rows)

    @torch.inference_mode()
    def prefill(self, features: torch.Tensor, next_tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Head outputs ``[n, hidden]`` over the prompt's pairs (f_j, x_{j+1}), written to slots ``0..n-1``."""
        n = next_tokens.numel()
        device = next_tokens.device
        positions = torch.arange(n, device=device)
        mask = causal_allowed(n, 0, device)[None, None]
        return self.lean(features[None], next_tokens[None], positions[None], positions, mask, cache.keys, cache.values)[0]

    def compile_seconds(self) -> dict[str, float]:
        functions = (*self._expand.values(), *self._advance.values(), *self._expand_rows.values(), *self._advance_rows.values())
        return {f.name: f.compile_s for f in functions if f.compile_s is not None}


def target_runtime(target: Target, compile: CompileConfig) -> TargetRuntime:
    """The shared runtime of ``target`` under ``compile`` (built on first use, kept on the target)."""
    runtimes = target.__dict__.setdefault("_runtimes", {})
    if compile not in runtimes:
        runtimes[compile] = TargetRuntime(target, compile)
    return runtimes[compile]


def head_runtime(head: EagleHead, target: Target, compile: CompileConfig) -> HeadRuntime:
    runtimes = head.__dict__.setdefault("_runtimes", {})
    if compile not in runtimes:
        runtimes[compile] = HeadRuntime(head, target, compile)
    return runtimes[compile]
