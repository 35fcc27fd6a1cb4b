"""Attention of the training-time test without the dense mask.

At depth k of the rollout (``eagle.loss.rollout``; EAGLE-3, arXiv 2503.01840 section 3.2) the queries of
the L origins read the head's cache of k x L keys: the L keys of the true features causally, then for each
earlier depth only the key of their own chain (one diagonal per depth). Through SDPA with a dense additive
``[L, k x L]`` mask that costs k times the causal attention, although each query sees at most L + k - 1
keys. Here the causal part runs as the flash kernel with ``is_causal`` (which skips the masked blocks) and
returns its log-sum-exp; the k - 1 diagonal scores are one dot product per query and chain key, and the
two are merged by their log-sum-exps (as flash attention merges blocks; Dao et al., arXiv 2205.14135).

The backward reuses the flash kernel's: for the causal part, the gradient of the merged softmax equals
the kernel's own gradient given ``a * dO`` (``a`` the causal part's weight in the merge) and the merged
output in place of the causal part's, because the kernel reads the output only for
``D = rowsum(dO * O)``; the diagonal terms are differentiated by hand.

``ChainMask`` is what the rollout passes as ``attention_mask``; the head's attention implementation
(``"eagle_chain"``, registered with transformers) takes this path for it on CPU and hands every other mask
(decoding's tree masks, ``None``) to transformers' SDPA attention unchanged. Elsewhere (CUDA) a
``ChainMask`` becomes the dense mask it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "eagle_chain"


@dataclass(frozen=True)
class ChainMask:
    """The mask of depth ``depth`` of the rollout over ``length`` origins: ``[1, 1, L, depth x L]``, the first
    block causal, each further block its diagonal."""

    length: int
    depth: int

    def dense(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        blocks = [torch.full((self.length, self.length), float("-inf"), dtype=dtype, device=device).triu(1)]
        diagonal = torch.full((self.length, self.length), float("-inf"), dtype=dtype, device=device).fill_diagonal_(0.0)
        blocks += [diagonal] * (self.depth - 1)
        return torch.cat(blocks, dim=1)[None, None]


class _ChainAttention(torch.autograd.Function):
    """q ``[B, H, L, D]``; k0 / v0 ``[B, H, L, D]`` (the causal keys, heads repeated for GQA); kc / vc
    ``[B, Hkv, n, L, D]`` (the n = depth - 1 chain keys of each origin); returns ``[B, H, L, D]``."""

    @staticmethod
    def forward(ctx, q, k0, v0, kc, vc, scale):
        aten = torch.ops.aten
        batch, heads, length, dim = q.shape
        kv_heads = kc.shape[1]
        groups = heads // kv_heads
        acc = torch.promote_types(q.dtype, torch.float32)  # merge in float32 (float64 stays float64)
        causal, lse_causal = aten._scaled_dot_product_flash_attention_for_cpu(q, k0, v0, 0.0, True, scale=scale)
        qg = q.view(batch, kv_heads, groups, length, dim)
        scores = torch.einsum("bkgld,bknld->bkgln", qg.to(acc), kc.to(acc)).mul_(scale)  # [B, Hkv, G, L, n]
        lse_causal_g = lse_causal.to(acc).view(batch, kv_heads, groups, length)
        lse = torch.logaddexp(lse_causal_g, torch.logsumexp(scores, dim=-1))
        a = torch.exp(lse_causal_g - lse)  # the causal part's weight in the merged softmax
        b = torch.exp(scores - lse.unsqueeze(-1))  # each chain key's
        out = a.unsqueeze(-1) * causal.view(batch, kv_heads, groups, length, dim).to(acc)
        out = out + torch.einsum("bkgln,bknld->bkgld", b, vc.to(acc))
        out = out.to(q.dtype).view(batch, heads, length, dim)
        ctx.save_for_backward(q, k0, v0, kc, vc, out, lse_causal, a, b)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kc, vc, out, lse_causal, a, b = ctx.saved_tensors
        scale = ctx.scale
        batch, heads, length, dim = q.shape
        kv_heads = kc.shape[1]
        groups = heads // kv_heads
        acc = b.dtype
        grad_g = grad_out.to(acc).view(batch, kv_heads, groups, length, dim)
        grad_causal = (a.unsqueeze(-1) * grad_g).view(batch, heads, length, dim).to(q.dtype)
        grad_q, grad_k0, grad_v0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_causal, q, k0, v0, out, lse_causal, 0.0, True, scale=scale
        )
        # the chain keys: dS = b * (dO . v - dO . O) for each score
        row = (grad_g * out.to(acc).view(batch, kv_heads, groups, length, dim)).sum(-1, keepdim=True)
        grad_scores = b * (torch.einsum("bkgld,bknld->bkgln", grad_g, vc.to(acc)) - row)
        grad_q = grad_q.to(acc) + scale * torch.einsum("bkgln,bknld->bkgld", grad_scores, kc.to(acc)).reshape(batch, heads, length, dim)
        qg = q.to(acc).view(batch, kv_heads, groups, length, dim)
        grad_kc = scale * torch.einsum("bkgln,bkgld->bknld", grad_scores, qg)
        grad_vc = torch.einsum("bkgln,bkgld->bknld", b, grad_g)
        return grad_q.to(q.dtype), grad_k0, grad_v0, grad_kc.to(kc.dtype), grad_vc.to(vc.dtype), None


def chain_attention(query, key, value, mask: ChainMask, scale: float) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, L, D]`` over ``key`` / ``value`` ``[B, Hkv, depth x L, D]`` under
    ``mask``; returns ``[B, H, L, D]``."""
    batch, kv_heads, kv_length, dim = key.shape
    heads, length = query.shape[1], query.shape[2]
    if kv_length != mask.depth * mask.length or length != mask.length:
        raise ValueError(f"a {mask} needs {mask.length} queries over {mask.depth * mask.length} keys, got {length} over {kv_length}")
    groups = heads // kv_heads

    def causal_part(x):  # the first block, each kv head repeated for its query heads
        block = x[:, :, :length]
        return block if groups == 1 else block[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(batch, heads, length, dim)

    if mask.depth == 1:  # causal attention alone: the flash kernel skips the masked blocks
        return torch.nn.functional.scaled_dot_product_attention(query, causal_part(key), causal_part(value), is_causal=True, scale=scale)
    kc = key.view(batch, kv_heads, mask.depth, length, dim)[:, :, 1:]
    vc = value.view(batch, kv_heads, mask.depth, length, dim)[:, :, 1:]
    return _ChainAttention.apply(query.contiguous(), causal_part(key).contiguous(), causal_part(value).contiguous(), kc, vc, scale)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The head's attention function (transformers' attention interface, ``"eagle_chain"``)."""
    if isinstance(attention_mask, ChainMask):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if query.device.type == "cpu" and dropout == 0.0 and not kwargs.get("softcap"):
            return chain_attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None
        attention_mask = attention_mask.dense(query.dtype, query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> str:
    """Register :func:`attention` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    return NAME
