"""eagle.chain_attention: the training-time test's attention without the dense mask equals SDPA under it,
output and gradients, with grouped-query heads; any other mask goes to SDPA unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle.chain_attention import ChainMask, attention, chain_attention


def _inputs(dtype, depth, batch=2, heads=4, kv_heads=2, length=9, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=generator).to(dtype).requires_grad_(True)
    k = torch.randn(batch, kv_heads, depth * length, dim, generator=generator).to(dtype).requires_grad_(True)
    v = torch.randn(batch, kv_heads, depth * length, dim, generator=generator).to(dtype).requires_grad_(True)
    return q, k, v


def _dense(q, k, v, mask: ChainMask):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask.dense(q.dtype, q.device)
    )


@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_chain_attention_equals_sdpa_under_the_dense_mask(depth, dtype, tolerance):
    mask = ChainMask(9, depth)
    q, k, v = _inputs(dtype, depth)
    grad = torch.randn(2, 4, 9, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = chain_attention(q, k, v, mask, 8**-0.5)
    got = torch.autograd.grad((out.float() * grad.float()).sum(), (q, k, v))
    reference = _dense(q, k, v, mask)
    want = torch.autograd.grad((reference.float() * grad.float()).sum(), (q, k, v))
    torch.testing.assert_close(out, reference, rtol=tolerance, atol=tolerance)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * max(1.0, float(w.abs().max())))


def test_the_attention_function_takes_the_chain_path_only_for_a_chain_mask():
    class Module(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    q, k, v = _inputs(torch.float32, 3)
    mask = ChainMask(9, 3)
    chained, _ = attention(Module(), q, k, v, mask, scaling=8**-0.5)
    torch.testing.assert_close(chained, _dense(q, k, v, mask).transpose(1, 2))
    tree = torch.zeros(1, 1, 9, 27)
    tree[..., 5] = float("-inf")  # any other additive mask: plain SDPA, as transformers computes it
    plain, _ = attention(Module(), q, k, v, tree, scaling=8**-0.5)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=tree).transpose(1, 2)
    torch.testing.assert_close(plain, expected)


def test_a_chain_mask_that_does_not_fit_the_keys_is_refused():
    q, k, v = _inputs(torch.float32, 2)
    with pytest.raises(ValueError, match="needs 9 queries over 27 keys"):
        chain_attention(q, k, v, ChainMask(9, 3), 1.0)
