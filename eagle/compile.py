"""Compiling the decoder's hot functions: one graph per fixed width, frozen weights, loud failures.

The decoder (``generate.py``) runs a handful of functions at fixed widths: the target's step at width 1
(plain decoding) and at the tree's width (verification), the head's draft step at the tree's expansion
width, its catch-up over the accepted path. Each (function, width) becomes one compiled graph; the KV
length and the cache capacity are marked dynamic, so one graph serves every context length and no request
recompiles (after warm-up every call runs under ``torch.compiler.set_stance("fail_on_recompile")``: a
recompile would be a bug, and it raises instead of silently costing seconds).

Settings (measured on the 2-core CPU with AMX, docs/benchmarks.md section 2): inductor with ``freezing``
(the frozen weights become constants: oneDNN linears on prepacked weights, fused elementwise kernels)
and, by default, ``max_autotune`` with the CPP GEMM templates (bf16 GEMMs at small widths, the
verification forward's cost). A one-token SmolLM2 step in bf16 goes from 48 ms (eager) to ~23 ms. The
price is paid once per process: ``CompiledFunction.compile_s`` records it. On CUDA the same functions
compile with ``mode="max-autotune"`` (CUDA graphs); the decoder then attends over the whole cache buffer
so that shapes are static.

``CompileConfig(mode="off")`` runs the same functions eagerly: the reference path, and the fallback a
user chooses (``--compile off``) when compilation fails; a failure raises ``EagleError`` naming it,
never falls back silently.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._inductor.config
from torch import nn
from torch._dynamo.utils import counters

from eagle import artifacts
from eagle.errors import EagleError

logger = logging.getLogger(__name__)

COMPILE_MODES = ("on", "off")


@dataclass(frozen=True)
class CompileConfig:
    """How the decoder's functions run.

    Attributes:
        mode: ``"on"`` compiles with torch.compile, ``"off"`` runs eagerly.
        autotune: benchmark GEMM implementations while compiling (inductor ``max_autotune``; slower to
            compile, faster bf16 verification on CPU).
        cpp_wrapper: on CPU, inductor's C++ wrapper (``cpp_wrapper``): a graph's kernels are called from
            generated C++ instead of a Python wrapper, and the call releases the GIL for the whole graph
            (``torch/_inductor/codegen/cpp_wrapper_cpu.py``, ``gil_scoped_release_simple``). That pays where
            other Python threads share the process: a Serve replica's event loops (SmolLM2 bf16, 2-core
            EPYC, one pair: 68-75 against 64-65 tok/s at 1 client; at 8 clients within the spread between
            replica starts, docs/benchmarks.md section 7);
            offline it is about level (23.8 against 24.7 ms) and compiling takes about 40 % longer.
    """

    mode: str = "on"
    autotune: bool = True
    cpp_wrapper: bool = False

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise EagleError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.mode == "on"


def _settings(device: torch.device, autotune: bool, cpp_wrapper: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(torch.compile keyword arguments, inductor config patched while the graph compiles). The inductor
    settings are patched around the first call rather than passed as ``options``: ``freezing`` passed that
    way was not applied (the weights stayed graph inputs, bf16 GEMMs ran unpacked, 52 vs 32 ms a step).
    With compiled artifacts on (``eagle.artifacts``), CPU weights are not prepacked into mkldnn tensors,
    which inductor's cache cannot store."""
    if device.type == "cuda":
        return {"mode": "max-autotune" if autotune else "reduce-overhead"}, {}
    inductor: dict[str, Any] = {"freezing": True}
    if artifacts.enabled():
        inductor["cpp.weight_prepack"] = False
    if autotune:
        inductor.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    if cpp_wrapper:
        inductor["cpp_wrapper"] = True
    return {}, inductor


class _Method(nn.Module):
    """``module.<method>`` as a module's forward: compiled as a module, its parameters are the graph's
    frozen constants (a bound method compiles with the weights as ordinary inputs: no prepacked weights,
    ~2x slower bf16 GEMMs on CPU)."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.module = module
        self.method = method

    def forward(self, *args):
        return getattr(self.module, self.method)(*args)


class CompiledFunction:
    """``module.<method>`` (or a plain function) compiled on first call (timed), then called without
    recompiling.

    ``dynamic`` maps argument positions to the dimensions that vary between calls (the KV length: dim 3 of
    the mask; the cache capacity: dim 2 of every cache buffer); for list arguments every tensor in the list
    is marked. On CUDA nothing is marked: the mask is padded to the cache's whole capacity (which the
    decoder keeps fixed there), so every call has one shape and CUDA graphs can replay it.
    """

    def __init__(
        self, fn: Callable | tuple[nn.Module, str], name: str, config: CompileConfig, device: torch.device, dynamic: dict[int, int]
    ) -> None:
        self.name = name
        self.config = config
        self.dynamic = dynamic
        self.compile_s: float | None = None
        self.loaded: bool | None = None  # whether the first call loaded the graph from compiled artifacts
        if isinstance(fn, tuple):
            fn = _Method(*fn)
        self.eager = fn
        self.device = device
        self._weights = fn.module if isinstance(fn, _Method) else fn if isinstance(fn, nn.Module) else None
        self.static_kv = device.type == "cuda"
        self._mask_at = next((i for i, dim in dynamic.items() if dim == 3), None)
        self._keys_at = next((i for i, dim in dynamic.items() if dim == 2), None)
        arguments, self._inductor = _settings(device, config.autotune, config.cpp_wrapper)
        self._compiled = torch.compile(fn, dynamic=False, **arguments) if config.enabled else None

    def _static(self, args: tuple) -> tuple:
        """The mask padded (with "may not attend") to the cache capacity: one shape for every call."""
        if not self.static_kv or self._mask_at is None or self._keys_at is None:
            return args
        mask, capacity = args[self._mask_at], args[self._keys_at][0].shape[2]
        padded = torch.nn.functional.pad(mask, (0, capacity - mask.shape[-1]), value=False)
        return args[: self._mask_at] + (padded,) + args[self._mask_at + 1 :]

    def _mark(self, args: tuple) -> None:
        if self.static_kv:
            return
        for position, dim in self.dynamic.items():
            value = args[position]
            for tensor in value if isinstance(value, (list, tuple)) else (value,):
                torch._dynamo.mark_dynamic(tensor, dim)

    @torch.inference_mode()  # the graphs are compiled for (and guarded on) inference mode
    def __call__(self, *args):
        if self._compiled is None:
            return self.eager(*args)
        args = self._static(args)
        if self.compile_s is None:
            self._mark(args)
            started = time.perf_counter()
            inductor = dict(self._inductor)
            if artifacts.activate(self.device) is not None:
                inductor["post_grad_custom_post_pass"] = artifacts.WeightsKey(artifacts.weights_digest(self._weights))
            hits = counters["inductor"]["fxgraph_cache_hit"]
            try:
                with torch._inductor.config.patch(inductor):
                    out = self._compiled(*args)
            except Exception as err:  # noqa: BLE001 - any compiler failure: say which function and what to do
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise EagleError(f"torch.compile failed for {self.name}: {first[:300]} (run with --compile off)") from err
            self.compile_s = time.perf_counter() - started
            self.loaded = counters["inductor"]["fxgraph_cache_hit"] > hits
            logger.info("%s %s in %.1f s", "loaded" if self.loaded else "compiled", self.name, self.compile_s)
            return out
        with torch.compiler.set_stance("fail_on_recompile"):
            try:
                return self._compiled(*args)
            except RuntimeError as err:
                if "recompil" in str(err).lower():
                    raise EagleError(f"{self.name} would recompile during a request: {str(err).splitlines()[0][:300]}") from err
                raise
