"""Our CPU decode-attention kernel (``eagle.decode_attention``) against PyTorch's SDPA: the same values within
fp32 rounding, for every row count it takes, both head sizes, cache slices and tails of a key block; the
model's ``attention`` hands it bf16 decode steps only; it compiles into an inductor graph, C++ wrapper too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle import decode_attention as kernel
from eagle.model import attention
from tiny import tiny_target

pytestmark = pytest.mark.skipif(not kernel._library(), reason="the kernel could not be built on this machine")


def reference(query, keys, values, mask, scale):
    """SDPA in float64, each query head reading kv head ``head // group``."""
    group = query.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    return F.scaled_dot_product_attention(query.double(), keys, values, attn_mask=mask, scale=scale)


def inputs(batch, heads, kv_heads, q, kv, dim, dtype, seed=0, capacity=None):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q, dim, generator=generator).to(dtype)
    capacity = capacity or kv
    # slices of a larger cache, as the model passes them: strided rows, a contiguous head dimension
    keys, values = (torch.randn(batch + 1, kv_heads, capacity, dim, generator=generator).to(dtype)[:batch, :, :kv] for _ in range(2))
    mask = torch.rand(batch, 1, q, kv, generator=generator) > 0.3
    mask[..., kv - 1] = True
    return query, keys, values, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_every_row_count_matches_sdpa(dtype, dim):
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (8 bits)
    shapes = [  # (heads, kv_heads, q): rows per kv head = heads / kv_heads * q, 1..8
        (4, 4, 1), (4, 4, 2), (9, 3, 1), (8, 2, 1), (9, 3, 2), (6, 1, 1), (7, 1, 1), (8, 2, 2), (4, 4, 8),
    ]
    for index, (heads, kv_heads, q) in enumerate(shapes):
        for kv in (1, 15, 16, 17, 300):  # tails of a 16-key block, one block, several
            query, keys, values, mask = inputs(3, heads, kv_heads, q, kv, dim, dtype, seed=index * 7 + kv, capacity=kv + 20)
            got = kernel.decode_attention(query, keys, values, mask, dim**-0.5)
            want = reference(query, keys, values, mask, dim**-0.5)
            assert got.dtype == dtype and got.shape == query.shape
            torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_masked_keys_are_ignored_and_a_row_that_sees_nothing_is_zero():
    query, keys, values, mask = inputs(2, 9, 3, 1, 40, 64, torch.float32)
    mask[:] = False
    mask[0, 0, 0, 5] = True  # row 0 sees one key: its output is that key's value, per head
    got = kernel.decode_attention(query, keys, values, mask, 0.125)
    for head in range(9):
        torch.testing.assert_close(got[0, head, 0], values[0, head // 3, 5])
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    changed = keys.clone()
    changed[0, :, 6:] = 100.0  # invisible keys: no effect
    assert torch.equal(kernel.decode_attention(query, changed, values, mask, 0.125)[0], got[0])


def test_bad_inputs_are_refused_with_a_message():
    query, keys, values, mask = inputs(1, 9, 3, 1, 20, 64, torch.float32)
    with pytest.raises(RuntimeError, match="at most 8 query rows"):
        kernel.decode_attention(torch.randn(1, 9, 3, 64), keys, values, torch.ones(1, 1, 3, 20, dtype=torch.bool), 0.1)
    with pytest.raises(RuntimeError, match="mask is bool"):
        kernel.decode_attention(query, keys, values, mask.float(), 0.1)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        kernel.decode_attention(query[..., :32], keys[..., :32], values[..., :32], mask, 0.1)


def test_attention_uses_the_kernel_for_bf16_decode_steps_only(monkeypatch):
    calls = []
    original = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a: calls.append(a[0].shape) or original(*a))
    for dtype, q, used in ((torch.bfloat16, 1, True), (torch.bfloat16, 2, True), (torch.bfloat16, 3, False), (torch.float32, 1, False)):
        calls.clear()
        query, keys, values, mask = inputs(2, 9, 3, q, 50, 64, dtype)
        got = attention(query, keys, values, mask, 0.125)
        assert bool(calls) == used, (dtype, q)
        torch.testing.assert_close(got.double(), reference(query, keys, values, mask, 0.125), atol=1e-2, rtol=1e-2)
    monkeypatch.setenv("EAGLE_DECODE_ATTENTION", "0")
    calls.clear()
    attention(*inputs(2, 9, 3, 1, 50, 64, torch.bfloat16)[:4], 0.125)
    assert not calls


@pytest.mark.nightly  # compiles a bf16 decode step twice
@pytest.mark.parametrize("cpp_wrapper", [False, True])
def test_a_compiled_bf16_decode_step_calls_the_kernel_and_matches_sdpa(cpp_wrapper, monkeypatch):
    """A tiny target with 64-wide heads (4 heads over 2 kv heads): its compiled one-token step, with the kernel
    inside the graph (inductor's Python or C++ wrapper), gives the logits of the SDPA step within bf16
    rounding, and the same greedy token."""
    from eagle.compile import CompileConfig
    from eagle.runtime import TargetRuntime, step_inputs
    from torch._dynamo.utils import counters

    target = tiny_target("llama", hidden_size=256, layers=2, dtype=torch.bfloat16)
    calls = []
    original = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a: calls.append(a[0].shape) or original(*a))
    results = {}
    for name, switch in (("sdpa", "0"), ("kernel", "1")):
        monkeypatch.setenv("EAGLE_DECODE_ATTENTION", switch)
        torch._dynamo.reset()
        runtime = TargetRuntime(target, CompileConfig(mode="on", cpp_wrapper=cpp_wrapper))
        cache = runtime.new_cache(64)
        with torch.inference_mode():
            runtime.prefill(torch.arange(1, 31), cache)
            ids, positions, slots, mask = step_inputs(1, 30, "cpu")
            ids = ids + 7
            calls.clear()
            counters.clear()
            _, logits, greedy = runtime.step(1)(ids, positions, slots, mask, cache.keys, cache.values)
        assert len(calls) == (2 if name == "kernel" else 0)  # traced once per layer, or not at all
        assert not counters["graph_break"], dict(counters["graph_break"])  # one graph: the kernel did not split it
        results[name] = (logits.clone(), greedy.clone())
    torch._dynamo.reset()
    torch.testing.assert_close(results["kernel"][0], results["sdpa"][0], atol=0.05, rtol=0.05)
    assert torch.equal(results["kernel"][1], results["sdpa"][1])
