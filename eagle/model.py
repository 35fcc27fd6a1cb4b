"""The lean forward pass: decoder layers over preallocated KV caches, on a loaded model's own weights.

gpt-fast style (pytorch-labs/gpt-fast, ``model.py``): one small function per piece, the whole forward in
this file, the KV cache a set of plain buffers that the forward writes in place at the slots it is given.
It runs the four architectures the engine supports (llama, mistral: plain; qwen2: q/k/v biases; qwen3:
RMSNorm on each head's q and k), reading every weight from the Hugging Face module that ``eagle.target``
loaded, so nothing is copied or converted. The numerics follow transformers' own modules (RMSNorm in
float32 then cast back, the rotary tables from the model's own rotary class).

Why not transformers' forward: eager, both cost the same on this CPU (47 vs 48 ms for a one-token step of
SmolLM2 in bf16, docs/benchmarks.md); the speed comes from ``torch.compile`` with frozen weights
(``eagle.compile``), and the lean forward gives the decoder what a ``Cache`` object does not: attention
over a prefix of a fixed buffer whose length is a dynamic dimension (one compiled graph serves every
context length), writes at arbitrary slots (tree nodes), and compaction of the accepted path as an
in-place gather inside the buffer (``KVCache.compact``).

Owns: ``KVCache``, ``LeanLayer`` (one decoder layer; ``LeanEagle3Layer``, an EAGLE-3 head's), ``LeanModel``
(embedding -> layers -> final norm, plus the LM head and bf16 near-tie rescoring, and the input streams of the
layers an EAGLE-3 head reads), ``rope_tables``.
Does not own: what to feed or when (``generate.py``), compile settings (``compile.py``), the draft head's
own wiring (``head.py`` builds its layer from ``LeanLayer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle import decode_attention
from eagle.errors import EagleError

# Candidates per row that ``LeanModel.greedy`` rescores in float32 (bf16 logits of SmolLM2 sit ~20 apart
# from zero, where one bf16 step is 0.125: exact ties among the top few are common, beyond 8 they are not).
RESCORE_CANDIDATES = 8
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class AttentionShape:
    """Head counts and sizes of one decoder layer."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> "AttentionShape":
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(heads, int(getattr(config, "num_key_value_heads", None) or heads), head_dim)


class KVCache:
    """Per-layer key and value buffers ``[rows, kv_heads, capacity, head_dim]``, written in place.

    One row per sequence (``rows=1`` for a single request; ``eagle.batch`` keeps one row per request of a
    batch, the padded-static-slots layout). In a row, slot ``i`` holds position ``i`` of the committed
    sequence once the decoder has committed it; slots past the committed length hold scratch (tree nodes
    being verified, padding) that no mask lets anyone see.
    """

    def __init__(self, layers: int, shape: AttentionShape, capacity: int, dtype: torch.dtype, device, rows: int = 1) -> None:
        self.capacity = capacity
        size = (rows, shape.kv_heads, capacity, shape.head_dim)
        with torch.inference_mode():  # inference tensors whoever allocates: the compiled graphs guard on it
            self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(layers)]

    def row(self, index: int) -> "KVCache":
        """Row ``index`` as a one-row cache sharing this cache's memory (views, written in place)."""
        view = KVCache.__new__(KVCache)
        view.capacity = self.capacity
        view.keys = [buffer[index : index + 1] for buffer in self.keys]
        view.values = [buffer[index : index + 1] for buffer in self.values]
        return view

    def compact(self, keep: int, source: torch.Tensor) -> None:
        """Move the slots ``source`` (ascending, all >= ``keep``) to ``keep, keep + 1, ...`` in every layer:
        after verification the accepted path follows the committed prefix without recomputation (EAGLE-2's
        KV update, arXiv 2406.16858). The gather reads before it writes, so overlapping ranges are safe."""
        end = keep + source.numel()
        for buffer in (*self.keys, *self.values):
            buffer[:, :, keep:end] = buffer.index_select(2, source)

    def compact_rows(self, rows: torch.Tensor, keep: torch.Tensor, source: torch.Tensor, counts: torch.Tensor) -> None:
        """``compact`` for several rows at once: in row ``rows[i]``, the ``counts[i]`` slots ``source[i]``
        (``[n, L]``, ascending, each >= ``keep[i]``; entries past ``counts[i]`` repeat the last one) move to
        ``keep[i], keep[i] + 1, ...``; one gather then one scatter per buffer."""
        steps = torch.minimum(torch.arange(source.shape[1], device=source.device)[None], (counts - 1)[:, None])
        target = keep[:, None] + steps  # [n, L]: padding repeats the last target (the same value twice)
        for buffer in (*self.keys, *self.values):
            moved = buffer[rows[:, None], :, source]  # [n, L, kv_heads, head_dim]
            buffer[rows[:, None], :, target] = moved


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled dot-product attention of ``query`` ``[B, heads, q, d]`` over ``keys`` / ``values`` ``[B, kv_heads,
    kv, d]`` (grouped-query: query head ``i`` reads kv head ``i // (heads / kv_heads)``, transformers' order)
    under ``mask`` ``[B, 1, q, kv]`` (bool, True = may attend); ``[B, heads, q, d]``.

    In bf16 / fp16 the heads that share a kv head are folded into the query length (``[B, kv_heads,
    group * q, d]``, the mask repeated per head) and attend without ``enable_gqa``: the same kernel and the
    same values bit for bit, and on CPU 3-7x faster for decode steps (torch 2.13, SmolLM2's 9 / 3 heads, bf16:
    111 vs 581 us for 8 rows of one token over 129 slots, 398 vs 2,734 us for 16 rows over 300, 34 vs 92 us
    for one row: ``enable_gqa``'s bf16 path is the slow one). float32 keeps ``enable_gqa`` (there it is the
    faster one). A CPU bf16 decode step (up to 8 query rows per kv head) goes to our own kernel instead
    (``eagle.decode_attention``: the same sums, 2.8-3.4x faster than SDPA for one token a row, 1.9x for two)."""
    if decode_attention.applies(query, keys, mask):
        return decode_attention.decode_attention(query, keys, values, mask, scale)
    batch, heads, q, dim = query.shape
    kv_heads = keys.shape[1]
    if heads == kv_heads:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    if query.dtype == torch.float32:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = heads // kv_heads
    folded = query.reshape(batch, kv_heads, group * q, dim)
    mask = mask[:, :, None].expand(batch, 1, group, q, mask.shape[-1]).reshape(batch, 1, group * q, mask.shape[-1])
    return F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale).view(batch, heads, q, dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(rotary: nn.Module, config, length: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[length, head_dim]`` from the model's own rotary module, for positions ``0..length-1``.
    Only rope types whose frequencies do not depend on the sequence length can be tabulated."""
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default") if isinstance(parameters, dict) else "default"
    if rope_type not in _STATIC_ROPE_TYPES:
        raise EagleError(f"rope type {rope_type!r} depends on the sequence length; the lean forward supports {', '.join(_STATIC_ROPE_TYPES)}")
    positions = torch.arange(length, device=device).unsqueeze(0)
    with torch.inference_mode(False), torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=dtype, device=device), positions)
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()


class LeanLayer(nn.Module):
    """One decoder layer (pre-norm attention + SwiGLU MLP) reading the weights of a transformers layer.

    The transformers submodules are registered here as they are (shared, not copied), so compiling with
    frozen parameters (``eagle.compile``) sees them as this module's constants.
    """

    def __init__(self, layer: nn.Module, config) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise EagleError(f"the lean forward implements SwiGLU MLPs (silu); this model uses {act!r}")
        self.shape = AttentionShape.of(config)
        attention, mlp = layer.self_attn, layer.mlp
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        # an EAGLE-1 head's layer may skip its input norm (``HeadConfig.input_norm``): an nn.Identity here
        self.skip_input_norm = isinstance(self.input_norm, nn.Identity)
        self.q_norm = getattr(attention, "q_norm", None)  # qwen3: RMSNorm over each head
        self.k_norm = getattr(attention, "k_norm", None)
        self.eps = float(getattr(self.post_norm, "variance_epsilon", getattr(config, "rms_norm_eps", 1e-6)))
        self.scale = float(getattr(attention, "scaling", self.shape.head_dim**-0.5))

    def forward(
        self,
        residual: torch.Tensor,  # [1, q, hidden]: the residual stream entering the layer
        cos: torch.Tensor,  # [1, 1, q, head_dim]
        sin: torch.Tensor,
        slots: torch.Tensor,  # [q] cache slots written by these tokens (batch 1), or [B, q]: per row
        mask: torch.Tensor,  # [B, 1, q, kv] bool: True = may attend; kv <= capacity
        keys: torch.Tensor,  # [rows >= B, kv_heads, capacity, head_dim]: rows 0..B-1 are this batch's
        values: torch.Tensor,
    ) -> torch.Tensor:
        """The layer's output residual stream ``[B, q, hidden]``; writes this step's keys and values."""
        x = residual if self.skip_input_norm else rms_norm(residual, self.input_norm.weight, self.eps)
        return self.block(x, residual, cos, sin, slots, mask, keys, values)

    def block(self, x, residual, cos, sin, slots, mask, keys, values) -> torch.Tensor:
        """Attention over ``x`` (the normed input, ``[B, q, in]``) added to ``residual`` ``[B, q, hidden]``,
        then the MLP: the layer after its input norm."""
        batch, q, _ = residual.shape
        shape = self.shape
        query = self.q_proj(x).view(batch, q, shape.heads, shape.head_dim)
        key = self.k_proj(x).view(batch, q, shape.kv_heads, shape.head_dim)
        value = self.v_proj(x).view(batch, q, shape.kv_heads, shape.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            query = rms_norm(query, self.q_norm.weight, self.q_norm.variance_epsilon)
            key = rms_norm(key, self.k_norm.weight, self.k_norm.variance_epsilon)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # [1, heads, q, head_dim]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        if slots.dim() == 1:
            keys.index_copy_(2, slots, key)
            values.index_copy_(2, slots, value)
        else:  # per-row slots: row b writes its q tokens at slots[b] (an index_put: scatter_ is ~50x slower on CPU)
            rows = torch.arange(batch, device=slots.device)[:, None]
            keys[rows, :, slots] = key.transpose(1, 2)
            values[rows, :, slots] = value.transpose(1, 2)
        kv = mask.shape[-1]  # the committed length + this step on CPU; the whole buffer on CUDA (eagle.compile)
        attended = attention(query, keys[:batch, :, :kv], values[:batch, :, :kv], mask, self.scale)  # [B, heads, q, head_dim]
        residual = residual + self.o_proj(attended.transpose(1, 2).reshape(batch, q, shape.heads * shape.head_dim))
        hidden = rms_norm(residual, self.post_norm.weight, self.eps)
        return residual + self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class LeanEagle3Layer(LeanLayer):
    """An EAGLE-3 head's decoder layer (arXiv 2503.01840; the layout of vLLM's ``llama_eagle3.py``): the
    attention reads ``[input_norm(embedding); hidden_norm(feature)]`` (2 x hidden; q/k/v are that wide) and
    adds to the feature itself (``norm_before_residual``: to its normed value), then the MLP as usual."""

    def __init__(self, layer: nn.Module, config, norm_before_residual: bool = False) -> None:
        super().__init__(layer, config)
        self.hidden_norm = layer.hidden_norm
        self.norm_before_residual = norm_before_residual

    def forward(self, residual, cos, sin, slots, mask, keys, values, embeds: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        normed = rms_norm(residual, self.hidden_norm.weight, self.eps)
        if self.norm_before_residual:
            residual = normed
        x = torch.cat([rms_norm(embeds, self.input_norm.weight, self.eps), normed], dim=-1)
        return self.block(x, residual, cos, sin, slots, mask, keys, values)


class LeanModel(nn.Module):
    """A target's backbone and LM head as ``LeanLayer``s over a ``KVCache``.

    ``forward`` returns features (the final-norm hidden states that feed the LM head, EAGLE's *feature*);
    ``step`` adds the LM head, and ``greedy`` the argmax after float32 rescoring of near-ties.

    ``head_layers`` (an EAGLE-3 head's ``aux_layers``): what ``hidden`` / ``step`` hand the head is then the
    residual streams entering those decoder layers, concatenated in that order (``[.., 3 x hidden]``),
    instead of the final features.
    """

    def __init__(self, backbone: nn.Module, lm_head: nn.Linear, config, max_positions: int, head_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        if any(not 0 <= i < len(backbone.layers) for i in head_layers):
            raise EagleError(f"head layers {head_layers} fall outside the target's {len(backbone.layers)} layers")
        self.head_layers = tuple(head_layers)
        self.embed_tokens = backbone.embed_tokens
        self.layers = nn.ModuleList(LeanLayer(layer, config) for layer in backbone.layers)
        self.norm = backbone.norm
        self.lm_head = lm_head
        self.eps = float(getattr(self.norm, "variance_epsilon", getattr(config, "rms_norm_eps", 1e-6)))
        self.shape = AttentionShape.of(config)
        self.max_positions = max_positions
        weight = lm_head.weight
        cos, sin = rope_tables(backbone.rotary_emb, config, max_positions, weight.dtype, weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.rescore = weight.dtype in (torch.bfloat16, torch.float16)

    def new_cache(self, capacity: int, rows: int = 1) -> KVCache:
        weight = self.lm_head.weight
        return KVCache(len(self.layers), self.shape, capacity, weight.dtype, weight.device, rows)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, q]
        positions: torch.Tensor,  # [B, q]
        slots: torch.Tensor,  # [q] (B = 1) or [B, q]
        mask: torch.Tensor,  # [B, 1, q, kv] bool
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """Features ``[B, q, hidden]``."""
        return self.hidden(input_ids, positions, slots, mask, keys, values)[0]

    def hidden(self, input_ids, positions, slots, mask, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
        """(features ``[B, q, hidden]``, the head's input ``[B, q, hidden or 3 x hidden]``: the features, or
        the ``head_layers``' input streams concatenated)."""
        residual = self.embed_tokens(input_ids)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [1, 1, q, head_dim]
        captured: dict[int, torch.Tensor] = {}
        for index, (layer, layer_keys, layer_values) in enumerate(zip(self.layers, keys, values)):
            if index in self.head_layers:
                captured[index] = residual
            residual = layer(residual, cos, sin, slots, mask, layer_keys, layer_values)
        features = rms_norm(residual, self.norm.weight, self.eps)
        if not self.head_layers:
            return features, features
        return features, torch.cat([captured[i] for i in self.head_layers], dim=-1)

    def step(self, input_ids, positions, slots, mask, keys, values) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the head's input ``[q, hidden or 3 x hidden]`` (see ``hidden``), logits ``[q, V]`` float32, greedy
        ids ``[q]``): one decode or verification step, the function ``eagle.compile`` compiles per width."""
        features, head_input = self.hidden(input_ids, positions, slots, mask, keys, values)
        features = features[0]
        logits = self.lm_head(features)
        return head_input[0], logits.float(), self.greedy(features, logits)

    def step_rows(self, input_ids, positions, slots, mask, keys, values) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``step`` over a batch (``eagle.batch``): (the head's input ``[B, q, ...]``, logits ``[B, q, V]``
        float32, greedy ids ``[B, q]``); row b reads and writes only cache row b."""
        features, head_input = self.hidden(input_ids, positions, slots, mask, keys, values)
        logits = self.lm_head(features)
        batch, q = input_ids.shape
        greedy = self.greedy(features.reshape(batch * q, -1), logits.reshape(batch * q, -1))
        return head_input, logits.float(), greedy.reshape(batch, q)

    def greedy(self, features: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Argmax per row ``[q]``. In bf16/fp16 the LM head's output is rounded to a few bits, so candidates
        tie exactly or differ by one rounding step where plain decoding and a tree forward (which round the
        backbone differently) would otherwise pick apart: the top ``RESCORE_CANDIDATES`` are rescored as
        float32 dot products of the same feature and weight rows, and the best of those wins."""
        if not self.rescore:
            return logits.argmax(dim=-1)
        candidates = logits.topk(RESCORE_CANDIDATES, dim=-1).indices  # [q, c]
        rows = self.lm_head.weight[candidates].float()  # [q, c, hidden]
        exact = torch.einsum("qch,qh->qc", rows, features.float())
        return candidates.gather(-1, exact.argmax(dim=-1, keepdim=True)).squeeze(-1)
