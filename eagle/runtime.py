"""The fast path's runtime: a target's and a head's lean modules and their compiled functions by width.

A ``TargetRuntime`` is built once per (target, compile settings) and shared by every ``Decoder`` on that
target (plain decoding, EAGLE, a hot-swapped head), so the target's graphs compile once per process. A
``HeadRuntime`` is built once per head. Both hand out ``CompiledFunction``s keyed by width; prefills (one
per request, prompt-length wide) run eagerly.

Does not own: the decode loop (``batch.py``) or compile settings (``compile.py``).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, TypeVar

import torch
from torch import nn

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
T = TypeVar("T")
# GEMM rows oneDNN packs the batched path's weights for (``PackedLinear``): a verification of a few rows
PACK_BATCH_HINT = 16


def cpuinfo_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU flags /proc/cpuinfo lists (its first ``flags`` line); None where it cannot be read or has none."""
    try:
        with open(cpuinfo) as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else set(flags)


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU computes in bfloat16 natively (``avx512_bf16`` or ``amx_bf16`` among the flags
    of /proc/cpuinfo). Without either, PyTorch emulates bf16 matmuls: on a 2-core AMD EPYC with AVX2 only, a
    [M, 576] x [576, 1536] matmul ran at ~16 GFLOPS in bf16 for every M, against 40-107 GFLOPS in float32 for
    M >= 16 (docs/benchmarks.md section 12). Where the flags cannot be read (not Linux) it answers True.
    ``EAGLE_NATIVE_BF16=0`` (or ``1``) overrides the flags: the tests run the other kind of machine's path with it."""
    override = os.environ.get("EAGLE_NATIVE_BF16")
    if override in ("0", "1"):
        return override == "1"
    flags = cpuinfo_flags(cpuinfo)
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & flags)


def preferred_dtype(dtype: str, *, gpu: bool = False) -> str:
    """``"auto"``: "bfloat16" on a GPU or a CPU that computes bf16 natively (``native_bf16``), else "float32";
    any other name is returned as given. Jobs resolve it once, on the driver, before it enters a dataset's
    or a run's identity, so what is recorded is the dtype that ran."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if gpu or native_bf16() else "float32"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def use_threads(threads: int | None) -> int:
    """Give the calling OS thread ``threads`` intra-op threads (None: every core this process may run on);
    returns the count.

    OpenMP keeps the thread count per OS thread: a thread started later begins at ``OMP_NUM_THREADS``, which
    Ray sets to 1 in its workers, and oneDNN's linears read that per-thread value; PyTorch copies its own
    setting into a new thread only lazily, on its first ``at::parallel_for``. So a thread that runs a model
    calls this first.
    """
    count = threads or available_cores()
    torch.set_num_threads(count)
    return count


def on_own_thread(fn: Callable[..., T], *args: Any, threads: int | None = None) -> T:
    """``fn(*args)`` on a new OS thread (with ``use_threads(threads)``), waited for: its result, or its error
    raised here.

    libgomp (PyTorch's OpenMP) gives every OS thread that starts a parallel region its own team of worker
    threads, kept until that thread exits; once a process has more of them than cores, every worker stops
    spinning between regions and sleeps, so each of a decode step's few hundred short parallel regions pays
    a wake-up. Measured here (SmolLM2 bf16, compiled, 2 cores): a batch-1 decode step ran at 70 tok/s as the
    process's only team and 34 tok/s while a second thread's team was alive (docs/benchmarks.md section 7).
    A server whose decoding runs on one long-lived thread therefore does its other model work (loading,
    compiling, warming up a new head) here, and that work's team ends with the thread.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        use_threads(threads)
        try:
            result.append(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            error.append(err)

    thread = threading.Thread(target=run, name=f"model-work-{getattr(fn, '__name__', 'fn')}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


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
    """The target's ``LeanModel``, its compiled ``step`` per width, and its eager prefill. ``head_layers``:
    the target layers an EAGLE-3 head reads (``LeanModel``); empty for plain decoding and EAGLE-1 heads."""

    def __init__(self, target: Target, compile: CompileConfig, head_layers: tuple[int, ...] = ()) -> None:
        self.target = target
        self.compile = compile
        self.head_layers = tuple(head_layers)
        self.model = self._lean()
        self._steps: dict[int, CompiledFunction] = {}
        self._row_steps: dict[int, CompiledFunction] = {}
        self._rows_model: LeanModel | None = None

    def _lean(self) -> LeanModel:
        target = self.target
        return LeanModel(target.backbone, target.lm_head, target.config, context_limit(target), self.head_layers)

    def step(self, width: int) -> CompiledFunction:
        """``LeanModel.step`` over ``width`` tokens: (the head's input ``[w, h or 3h]``, logits ``[w, V]``,
        greedy ids ``[w]``)."""
        if width not in self._steps:
            self._steps[width] = CompiledFunction(
                (self.model, "step"), f"{self.target.name} step[{width}]", self.compile, self.target.device, _STEP_DYNAMIC
            )
        return self._steps[width]

    def rows_step(self, batch: int) -> CompiledFunction:
        """``LeanModel.step_rows`` compiled for exactly ``batch`` rows of one token each (a plain batched step;
        the KV length stays dynamic): ``eagle.batch``'s graphs per padded batch size."""
        if batch not in self._row_steps:
            self._row_steps[batch] = CompiledFunction(
                (self.model, "step_rows"), f"{self.target.name} rows[{batch}]", self.compile, self.target.device, _STEP_DYNAMIC
            )
        return self._row_steps[batch]

    @property
    def rows_model(self) -> LeanModel:
        """The model prefills and the batched path (``eagle.batch``) run eagerly: under ``compile="on"`` on CPU in
        bf16/fp16 a second ``LeanModel`` whose linears are prepacked for oneDNN (``PackedLinear``), else
        ``self.model``. Why eager: compiled with a dynamic batch dimension, the step ran 3-30x slower
        than eager and erratically (inductor freezing on this CPU, docs/benchmarks.md section 7), and a
        graph per batch size costs about a minute of compilation each: those are opt-in (``rows_step``,
        ``BatchDecoder(graphs=...)``)."""
        if self._rows_model is None:
            if self.compile.enabled and packable(self.model.lm_head.weight):
                self._rows_model = pack_linears(self._lean())
            else:
                self._rows_model = self.model
        return self._rows_model

    def new_cache(self, capacity: int, rows: int = 1) -> KVCache:
        return self.model.new_cache(capacity, rows)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(features ``[n, hidden]``, the head's input ``[n, hidden or 3 x hidden]``) of ``prompt`` ``[n]``,
        written to cache slots ``0..n-1``. Runs eagerly on ``rows_model`` (prepacked linears where those
        apply: 8 MT-bench prompts 0.62-0.64 s against 0.67-0.70 s, docs/benchmarks.md section 7)."""
        n = prompt.numel()
        device = prompt.device
        positions = torch.arange(n, device=device)
        features, head_input = self.rows_model.hidden(prompt[None], positions[None], positions, causal_allowed(n, 0, device)[None, None], cache.keys, cache.values)
        return features[0], head_input[0]

    def compile_seconds(self) -> dict[str, float]:
        return {f.name: f.compile_s for f in (*self._steps.values(), *self._row_steps.values()) if f.compile_s is not None}


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
        self._head = head
        self._max_positions = context_limit(target)
        self._rows_lean: LeanHead | None = None

    @property
    def rows_lean(self) -> LeanHead:
        """The head prefills and the batched path run eagerly (its layer's linears prepacked as
        ``TargetRuntime.rows_model``'s)."""
        if self._rows_lean is None:
            if self.compile.enabled and packable(self.lean.fc.weight):
                self._rows_lean = pack_linears(LeanHead(self._head, self._max_positions))
            else:
                self._rows_lean = self.lean
        return self._rows_lean

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
    def prefill(self, features: torch.Tensor, next_tokens: torch.Tensor, cache: KVCache, start: int = 0) -> torch.Tensor:
        """Head outputs ``[n, hidden]`` over the pairs (f_j, x_{j+1}) at positions ``start..start+n-1``,
        written to those cache slots (eagerly, on ``rows_lean``): the prompt's pairs (``start`` 0), or a
        batch row's catch-up over more pairs than a compiled catch-up takes."""
        n = next_tokens.numel()
        device = next_tokens.device
        positions = torch.arange(start, start + n, device=device)
        mask = causal_allowed(n, start, device)[None, None]
        return self.rows_lean(features[None], next_tokens[None], positions[None], positions, mask, cache.keys, cache.values)[0]

    def compile_seconds(self) -> dict[str, float]:
        return {f.name: f.compile_s for f in (*self._expand.values(), *self._advance.values()) if f.compile_s is not None}


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is prepacked once for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``)
    and applied eagerly (``torch.ops.mkldnn._linear_pointwise``): the weight layout inductor's freezing
    gives compiled graphs, without compiling. Same results as ``F.linear`` (the same oneDNN kernels);
    ``weight`` stays the original tensor for whoever reads it (``LeanModel.greedy``'s rescoring)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def packable(weight: torch.Tensor) -> bool:
    """Whether ``PackedLinear`` applies: a CPU bf16/fp16 weight, a oneDNN build of torch and a CPU whose
    oneDNN packs that dtype (bf16 needs AVX512BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU refuses it)."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16) and _packs(weight.dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN prepacks linear weights of ``dtype``: tried once on a small weight."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


_PACKED_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "fc")


def pack_linears(module: nn.Module) -> nn.Module:
    """Replace the linears a ``LeanModel`` / ``LeanHead`` (and their ``LeanLayer``s) call by ``PackedLinear``s,
    in place on this lean instance (the transformers modules it reads stay as they are). Fusing q|k|v and
    gate|up into one packed GEMM each was measured and dropped: 40 vs 33 ms a batch-2 step of SmolLM2.

    A ``LeanHead`` holds its ``EagleHead`` (``.head``), which every other runtime of that head shares and
    reads through (an EAGLE-3 head's ``draft_weight`` is ``head.lm_head.weight``): that subtree is not
    walked. Packing its ``lm_head`` in place once changed a module type that compiled graphs guard on, and
    each serving request with an EAGLE-3 head failed with "would recompile" (2026-12-04)."""

    def owners(m: nn.Module):
        yield m
        for child in m.children():
            if not isinstance(child, EagleHead):
                yield from owners(child)

    for owner in owners(module):
        for name in _PACKED_ATTRIBUTES:
            linear = owner._modules.get(name)
            if isinstance(linear, nn.Linear):
                setattr(owner, name, PackedLinear(linear))
    return module


def target_runtime(target: Target, compile: CompileConfig, head_layers: tuple[int, ...] = ()) -> TargetRuntime:
    """The shared runtime of ``target`` under ``compile`` for heads reading ``head_layers`` (built on first
    use, kept on the target)."""
    runtimes = target.__dict__.setdefault("_runtimes", {})
    key = (compile, tuple(head_layers))
    if key not in runtimes:
        runtimes[key] = TargetRuntime(target, compile, key[1])
    return runtimes[key]


def head_runtime(head: EagleHead, target: Target, compile: CompileConfig) -> HeadRuntime:
    runtimes = head.__dict__.setdefault("_runtimes", {})
    if compile not in runtimes:
        runtimes[compile] = HeadRuntime(head, target, compile)
    return runtimes[compile]
