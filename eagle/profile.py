"""Micro-timings that size the draft tree: the target's step over N tokens, one draft step, compile costs.

On a CPU the verification forward's cost grows with the tree and the draft's cost is dominated by the LM
head over the draft vocabulary, so these numbers decide which tree sizes can pay off. They are measured on
the decoder's own functions (``eagle.runtime``: the lean forward over a ``KVCache``, compiled or eager),
after a cached context of ``context`` tokens.

Does not own: end-to-end speed (``bench.py``) or the tree choice (``autotree.py``, which reuses ``time_ms``).
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from typing import Callable, Sequence

import torch

from eagle.compile import CompileConfig
from eagle.head import EagleHead
from eagle.runtime import cpuinfo_flags, head_runtime, step_inputs, target_runtime
from eagle.target import Target, load_target

logger = logging.getLogger(__name__)


def time_ms(fn: Callable[[], object], repeats: int, device: torch.device | None = None) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls, after one untimed call (on a CUDA ``device``
    each call is timed until its kernels finished)."""
    def sync() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    samples = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def cpu_flags() -> list[str]:
    """The matrix-extension flags oneDNN uses (AMX, AVX-512 BF16), as /proc/cpuinfo reports them."""
    return sorted(f for f in cpuinfo_flags() or () if f.startswith("amx") or f in ("avx512f", "avx512_bf16", "avx512_fp16", "avx2"))


def machine() -> dict:
    model = None
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), None)
    except OSError:
        pass
    return {
        "machine": platform.machine(), "cpu": model or platform.processor() or None, "cpu_flags": cpu_flags(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }


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
    compile: str = "off",
    device: str = "cpu",
) -> dict:
    """Median milliseconds of the target's step (LM head included) over each width after ``context`` cached
    tokens, and of one draft step (head forward over ``draft_width`` rows + draft LM head + top-k) for each
    draft vocabulary; with ``compile="on"`` also each function's compile seconds (the cold start)."""
    if isinstance(target, str):
        target = load_target(target, dtype=dtype, device=device)
    config = CompileConfig(mode=compile)
    runtime = target_runtime(target, config)
    device = target.device
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=generator).to(device)
    capacity = context + max(max(sizes), draft_width) + 1
    cache = runtime.new_cache(capacity)
    features, _ = runtime.prefill(prompt, cache)
    result: dict = {
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "context": context,
        "compile": compile,
        **machine(),
        "target_step_ms": {},
        "draft_step_ms": {},
        "compile_s": {},
    }
    for size in sizes:
        step = runtime.step(size)
        inputs = step_inputs(size, context, device)
        result["target_step_ms"][size] = round(time_ms(lambda: step(*inputs, cache.keys, cache.values), repeats, device), 2)
        if step.compile_s is not None:
            result["compile_s"][step.name] = round(step.compile_s, 1)
        logger.info("target step over %d tokens: %.1f ms", size, result["target_step_ms"][size])

    for vocab in list(draft_vocabs) or [target.vocab_size]:
        draft_ids = None if vocab >= target.vocab_size else torch.arange(vocab)
        head = EagleHead.for_target(target, seed=0, draft_token_ids=draft_ids)
        heads = head_runtime(head, target, config)
        head_cache = heads.new_cache(capacity)
        heads.prefill(features, prompt, head_cache)
        expand = heads.expand(draft_width)
        ids, positions, slots, mask = step_inputs(draft_width, context, device)
        width_features = features[-draft_width:][None]
        result["draft_step_ms"][vocab] = round(
            time_ms(lambda: expand(width_features, ids, positions, slots, mask, head_cache.keys, head_cache.values, draft_width), repeats, device), 2
        )
        if expand.compile_s is not None:
            result["compile_s"][f"{expand.name} vocab {vocab}"] = round(expand.compile_s, 1)
        logger.info("draft step (%d rows, vocab %d): %.1f ms", draft_width, vocab, result["draft_step_ms"][vocab])
    return result
