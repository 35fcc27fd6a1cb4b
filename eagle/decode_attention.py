"""Our CPU kernel for the attention of a decode step: a few query rows over a long KV cache.

On CPU, PyTorch's SDPA flash kernel takes 190-365 us a layer for a decode step of 8 rows of SmolLM2-135M over
300 keys: 6-10 ms of a 30-layer step (docs/benchmarks.md section 7). ``csrc/decode_attention.cpp`` does the
same sums for up to 8 query rows per kv head (the heads that share it times the query length) in one pass
over the keys, with fp32 accumulation: 2.8-3.4x faster than SDPA for one token a row, 1.9x for two
(docs/benchmarks.md section 7). It is registered as ``torch.ops.eagle.decode_attention`` with a fake (meta)
implementation, so ``torch.compile`` keeps it as one extern call; inductor's C++ wrapper calls it through
the dispatcher, without the GIL.

The source is compiled once per machine with ``torch.utils.cpp_extension`` (about 20 s; g++ and ninja, both
already needed by inductor and DeepSpeed) into ``TORCH_EXTENSIONS_DIR``, under a name that includes a hash of
the CPU's flags: the build uses ``-march=native``, so machines whose CPUs report different flags never share
a binary through a shared cache. Where the build fails the caller falls back to SDPA and the failure is logged once.
``EAGLE_DECODE_ATTENTION=0`` turns the kernel off (for side-by-side measurements)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
MAX_ROWS = 8  # query rows per kv head the kernel takes (heads per kv head x query length)
HEAD_DIMS = (64, 128)


def enabled() -> bool:
    """``EAGLE_DECODE_ATTENTION`` is not ``0``."""
    return os.environ.get("EAGLE_DECODE_ATTENTION", "1") != "0"


@functools.cache
def _library() -> bool:
    """Build (once per machine) and load the kernel; False, logged once, where that fails."""
    from eagle.runtime import cpuinfo_flags  # runtime imports model, which imports this module

    fingerprint = hashlib.sha256(" ".join(sorted(cpuinfo_flags() or ())).encode()).hexdigest()[:10]
    try:
        from torch.utils.cpp_extension import load

        log.info("loading the decode-attention kernel (the first time on a machine it compiles, about 20 s)")
        load(
            name=f"eagle_decode_attention_{fingerprint}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            is_python_module=False,
        )
    except Exception as error:  # no compiler, no ninja, a compile error: SDPA stays in use
        log.warning("decode-attention kernel unavailable, using SDPA: %s", str(error).splitlines()[0] if str(error) else error)
        return False

    @torch.library.register_fake("eagle::decode_attention")
    def _(query, keys, values, mask, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    return True


@torch.compiler.assume_constant_result  # dynamo calls these while tracing and keeps the answer: no graph break
def built() -> bool:
    """The kernel is built and loaded (``_library``)."""
    return _library()


@torch.compiler.assume_constant_result
def ready() -> bool:
    """The kernel is on (``enabled``) and built (``built``)."""
    return enabled() and built()


def applies(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``attention`` hands these shapes to the kernel: a CPU bf16 decode step (query ``[B, heads, q,
    d]`` with ``heads / kv_heads * q <= 8``, d 64 or 128, the last dimension contiguous) under a bool mask
    ``[B, 1, q, kv]``, the kernel on and built. fp32 keeps SDPA: the lossless tests' reference path stays
    PyTorch's own."""
    heads, q, dim = query.shape[1], query.shape[2], query.shape[3]
    return (
        query.device.type == "cpu"
        and query.dtype == torch.bfloat16
        and mask.dtype == torch.bool
        and mask.shape[0] == query.shape[0]
        and mask.shape[1] == 1
        and query.stride(-1) == 1
        and keys.stride(-1) == 1
        and dim in HEAD_DIMS
        and heads // keys.shape[1] * q <= MAX_ROWS
        and ready()
    )


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``eagle.model.attention``'s result (``[B, heads, q, d]``) from the kernel: query ``[B, heads, q, d]``,
    keys / values ``[B, kv_heads, kv, d]`` (any strides but a contiguous last dimension, such as a slice of the
    cache), mask ``[B, 1, q, kv]`` bool (True = may attend; a row that may attend to nothing gets zeros).
    bf16 or fp32; the kernel must be loaded (``applies``)."""
    if not built():
        raise RuntimeError("the decode-attention kernel is not available on this machine")
    return torch.ops.eagle.decode_attention(query, keys, values, mask, scale)
