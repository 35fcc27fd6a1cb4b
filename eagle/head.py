"""The EAGLE draft head.

Owns: the module, in two kinds (``HeadConfig.kind``), the optional reduced draft vocabulary, and the
on-disk format (``config.json`` + ``model.safetensors``):

* ``eagle1``: fc over [embedding(token t+1); feature t], then one decoder layer built from the target's own
  config; its output is the predicted next feature, which the target's LM head reads.
* ``eagle3`` (EAGLE-3, arXiv 2503.01840, section 3): fc(3h -> h) fuses the residual streams entering three
  target layers (``aux_layers``, by default 2, L//2, L-3: low, middle, high); the decoder layer's attention
  reads [input_norm(embedding); hidden_norm(fused)] (2h wide q/k/v, the layout of vLLM's and SGLang's
  ``llama_eagle3.py`` and of SafeAILab's EAGLE-3 ``cnets.py``) and its residual is the fused feature; its
  output is not a target feature but the head's own state: a final norm and the draft LM head turn it into
  the draft distribution, and deeper draft steps feed it back instead of the fused features (no fc).
  Its draft LM head (``lm_head.weight``, draft vocabulary x h) is the head's own tensor, initialised from
  the target's rows and kept frozen by training (``requires_grad=False``), so the checkpoint has the
  layout the EAGLE-3 loaders read.

EAGLE (Li et al., ICML 2024, arXiv 2401.15077, section 4.1): the head autoregresses on features. At
position j its input is the target's feature f_j fused with the embedding of the token x_{j+1} one step
ahead (the "shifted token" that removes feature uncertainty); its output predicts f_{j+1}, and the
target's frozen LM head turns that into a distribution for x_{j+2}.

The embedding and LM head are *shared* with the target and frozen: they are never stored in the head's
checkpoint. A reduced draft vocabulary (EAGLE-3, arXiv 2503.01840) keeps only the LM-head rows of the most
frequent tokens; ``d2t[i]`` is the offset from draft id ``i`` to its target id and ``t2d`` marks target ids
in the draft vocabulary — the key names and semantics of the reference checkpoints, so heads can be
exported to vLLM / SGLang.

Deviation from the EAGLE-1 reference (``cnets.py``): the reference skips the first layer's input
RMSNorm; we keep the target's decoder layer unchanged (as vLLM's ``llama_eagle.py`` builds it).

``LeanHead`` is the same head on the decoder's fast path: its layer is ``eagle.model.LeanLayer`` over the
transformers layer's own weights, with a preallocated ``KVCache``; ``expand`` is one draft step (head
forward, draft LM head, log-softmax, top-k, draft -> target ids), the function the decoder compiles.

Does not own: drafting (``tree.py``) or training (``loss.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from eagle.errors import EagleError, HeadMismatchError
from eagle.model import AttentionShape, KVCache, LeanEagle3Layer, LeanLayer, rope_tables
from eagle.target import adapter_for

if TYPE_CHECKING:
    from eagle.target import Target

logger = logging.getLogger(__name__)

HEAD_FORMAT = "eagle-head/1"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class HeadConfig:
    """What a head directory's ``config.json`` holds.

    Attributes:
        hidden_size: the target's hidden size (fc maps 2*hidden -> hidden).
        vocab_size: the target's vocabulary size (the embedding / LM head the head borrows).
        draft_vocab_size: rows of the draft LM head; equal to ``vocab_size`` unless reduced.
        model_type: the target architecture (``config.model_type``) the decoder layer comes from.
        layer_config: the target's transformers config as a dict with ``num_hidden_layers=1``.
        target_name / target_revision: the target this head was trained for (informational; the
            platform's registry checks the revision).
        fc_bias: whether fc has a bias (the EAGLE-1 reference: yes; vLLM's ``eagle`` and EAGLE-3: no).
        input_norm: whether the decoder layer applies its input RMSNorm to fc's output. The EAGLE-1
            reference (``cnets1.py``) and vLLM's ``llama_eagle.py`` replace layer 0's input norm by the
            identity (False); heads saved before this field existed keep it (the default, True).
        kind: ``eagle1`` or ``eagle3`` (module docstring); heads saved before this field are ``eagle1``.
        aux_layers: ``eagle3`` only: the target layers whose input streams fc fuses, low / middle / high.
        norm_before_residual: ``eagle3`` only: the layer's residual is the normed feature (vLLM's config
            field of that name); False, the EAGLE-3 reference's layout, adds to the feature itself.
    """

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    model_type: str
    layer_config: dict[str, Any]
    target_name: str = "unknown"
    target_revision: str = "unknown"
    fc_bias: bool = True
    input_norm: bool = True
    kind: str = "eagle1"
    aux_layers: list[int] | None = None
    norm_before_residual: bool = False
    format: str = HEAD_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(
        cls,
        target: "Target",
        draft_vocab_size: int | None = None,
        *,
        fc_bias: bool = True,
        input_norm: bool = True,
        kind: str = "eagle1",
        aux_layers: Iterable[int] | None = None,
    ) -> "HeadConfig":
        """The config of a head for ``target``; an ``eagle3`` head reads ``aux_layers`` (default
        ``default_aux_layers``) and has no fc bias."""
        if kind not in HEAD_KINDS:
            raise EagleError(f"head kind must be one of {', '.join(HEAD_KINDS)}, got {kind!r}")
        if kind == "eagle3":
            aux = list(aux_layers) if aux_layers is not None else list(default_aux_layers(target.config.num_hidden_layers))
            fc_bias, input_norm = False, True
        else:
            aux = None
        layer_config = target.config.to_dict()
        layer_config["num_hidden_layers"] = 1
        if "layer_types" in layer_config:  # hybrid configs list one type per layer; the head's layer is full attention
            layer_config["layer_types"] = ["full_attention"]
        for key in ("quantization_config", "auto_map", "_name_or_path", "architectures", "torch_dtype", "dtype"):
            layer_config.pop(key, None)
        return cls(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            model_type=target.config.model_type,
            layer_config=layer_config,
            target_name=target.name,
            target_revision=target.revision,
            fc_bias=fc_bias,
            input_norm=input_norm,
            kind=kind,
            aux_layers=aux,
        )

    @property
    def input_size(self) -> int:
        """Width of the target features the head reads: 3 x hidden for ``eagle3``, hidden for ``eagle1``."""
        return 3 * self.hidden_size if self.kind == "eagle3" else self.hidden_size

    @property
    def head_layers(self) -> tuple[int, ...]:
        """The target layers whose input streams the head reads (``LeanModel``); empty for ``eagle1``."""
        return tuple(self.aux_layers or ()) if self.kind == "eagle3" else ()

    @classmethod
    def read(cls, directory: str | Path) -> "HeadConfig":
        """The ``config.json`` of a head directory in this engine's layout; ``EagleError`` when there is none
        or it is not a head config."""
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            raise EagleError(f"{directory} is not a head directory (no {CONFIG_NAME})")
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise EagleError(f"{path} is not a valid head config: {err}") from None

    def transformers_config(self):
        from transformers import AutoConfig

        settings = {k: v for k, v in self.layer_config.items() if k != "model_type"}
        config = AutoConfig.for_model(self.model_type, **settings)
        from eagle.chain_attention import register

        config._attn_implementation = register()  # SDPA, and the rollout's chain masks without a dense mask
        return config


HEAD_KINDS = ("eagle1", "eagle3")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers: the streams entering decoder layers ``2, L//2, L-3`` (the
    reference's and vLLM's default), clamped into ``[0, L-1]`` for shallow targets. Index ``i`` is
    transformers' ``hidden_states[i]`` (0 = the embeddings)."""
    return tuple(max(0, min(num_layers - 1, i)) for i in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


class EagleHead(nn.Module):
    """One decoder layer behind an fc; embedding (and for ``eagle1`` the LM head) borrowed from an attached
    target. See the module docstring for the two kinds."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.eagle3 = config.kind == "eagle3"
        layer_config = config.transformers_config()
        adapter = adapter_for(layer_config)
        hidden = config.hidden_size
        layer = adapter.decoder_layer_cls()(layer_config, layer_idx=0)
        if self.eagle3:
            self.fc = nn.Linear(3 * hidden, hidden, bias=False)
            attention = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding; feature]
                old = getattr(attention, name)
                setattr(attention, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
            norm_cls = type(layer.post_attention_layernorm)
            eps = float(getattr(layer_config, "rms_norm_eps", 1e-6))
            layer.hidden_norm = norm_cls(hidden, eps=eps)
            self.norm = norm_cls(hidden, eps=eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)  # the target's rows: set by for_target, frozen
        else:
            self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
            if not config.input_norm:
                layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = adapter.rotary_cls()(layer_config)
        self.reduced_vocab = config.draft_vocab_size != config.vocab_size
        if self.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        # Borrowed, frozen, never saved: kept out of the module tree on purpose.
        self._borrowed: dict[str, torch.Tensor | nn.Module] = {}

    # ---- construction ------------------------------------------------------------------------------

    @classmethod
    def for_target(
        cls,
        target: "Target",
        *,
        seed: int | None = 0,
        draft_token_ids: torch.Tensor | None = None,
        fc_bias: bool = True,
        input_norm: bool = True,
        kind: str = "eagle1",
        aux_layers: Iterable[int] | None = None,
    ) -> "EagleHead":
        """An untrained head for ``target`` (fixed ``seed``), optionally with a reduced draft vocabulary;
        ``fc_bias`` / ``input_norm`` / ``kind`` / ``aux_layers`` as in ``HeadConfig`` (``eagle1`` with both
        False: the layout vLLM's ``eagle`` builds)."""
        draft_vocab_size = None if draft_token_ids is None else int(draft_token_ids.numel())
        config = HeadConfig.for_target(
            target, draft_vocab_size, fc_bias=fc_bias, input_norm=input_norm, kind=kind, aux_layers=aux_layers
        )
        devices = [target.device] if target.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            head = cls(config)
        if draft_token_ids is not None:
            head.set_draft_vocab(draft_token_ids)
        head = head.to(device=target.device, dtype=target.dtype).attach(target)
        if head.eagle3:
            head.copy_target_lm_head()
        return head

    def copy_target_lm_head(self) -> None:
        """An ``eagle3`` head's own draft LM head := the attached target's draft-vocabulary rows."""
        with torch.no_grad():
            self.lm_head.weight.copy_(self._borrowed["lm_weight"])

    def set_draft_vocab(self, draft_token_ids: torch.Tensor) -> None:
        """Set the reduced vocabulary from target ids (any order; stored sorted, EAGLE-3 d2t/t2d)."""
        if not self.reduced_vocab:
            raise EagleError("this head uses the full vocabulary")
        ids = torch.unique(draft_token_ids.to(torch.long))  # sorted
        if ids.numel() != self.config.draft_vocab_size:
            raise EagleError(f"draft vocabulary needs {self.config.draft_vocab_size} distinct ids, got {ids.numel()}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise EagleError("draft vocabulary ids fall outside the target vocabulary")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def attach(self, target: "Target") -> "EagleHead":
        """Borrow ``target``'s embedding and LM head (its draft-vocabulary rows: the target's distribution in
        training, and an ``eagle1`` head's own LM head); fails clearly if the head was built for another
        target."""
        check_compatible(self.config, target)
        self._borrowed["embed"] = target.embed_tokens
        weight = target.lm_head.weight
        if self.reduced_vocab:
            weight = weight.index_select(0, self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=weight.device)))
        self._borrowed["lm_weight"] = weight.detach()
        return self

    # ---- forward -------------------------------------------------------------------------------------

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (identity for a full-vocabulary head)."""
        if not self.reduced_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        features: torch.Tensor,  # [B, q, input_size or hidden]: the target's (fused) features, or the head's own output
        next_tokens: torch.Tensor,  # [B, q]: x_{j+1}
        cache,
        position_ids: torch.Tensor,  # [B, q]
        attention_mask: torch.Tensor | None = None,  # [B, 1, q, kv] additive
    ) -> torch.Tensor:
        """The head's output ``[B, q, hidden]``: ``eagle1``, the predicted next features; ``eagle3``, its state
        before the final norm (``draft_logits`` reads either)."""
        if "embed" not in self._borrowed:
            raise EagleError("head is not attached to a target: call head.attach(target)")
        embeds = self._borrowed["embed"](next_tokens).to(features.dtype)  # [B, q, hidden]
        if self.eagle3:
            return self._eagle3_layer(self.fuse(features), embeds, cache, position_ids, attention_mask)
        hidden = self.fc(torch.cat([embeds, features], dim=-1))  # [1, q, hidden]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )
        return hidden

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``eagle3``: the target's fused features ``[..., 3h]`` through fc; the head's own output
        ``[..., h]`` (deeper draft steps) as it is."""
        return self.fc(features) if features.shape[-1] != self.config.hidden_size else features

    def _eagle3_layer(self, hidden, embeds, cache, position_ids, attention_mask) -> torch.Tensor:
        """The EAGLE-3 decoder layer (module docstring) on transformers' attention and MLP modules."""
        layer = self.layers[0]
        normed = layer.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        attended, _ = layer.self_attn(
            hidden_states=x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=cache is not None, position_embeddings=position_embeddings,
        )
        hidden = residual + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary for the head's output ``[..., hidden]`` (``eagle3``: after
        its final norm, through its own LM head): ``draft_weight @ draft_input(hidden)``."""
        return torch.nn.functional.linear(self.draft_input(hidden), self.draft_weight).float()

    def draft_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft LM head reads from the head's output: its final norm's output (``eagle3``) or the
        output itself (``eagle1``, whose output is a target feature)."""
        return self.norm(hidden) if self.eagle3 else hidden

    @property
    def draft_weight(self) -> torch.Tensor:
        """The draft LM head ``[draft vocabulary, hidden]``: the head's own frozen rows (``eagle3``) or the
        target's, borrowed (``eagle1``)."""
        return self.lm_head.weight if self.eagle3 else self._borrowed["lm_weight"]

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the target's LM head over the draft vocabulary for the target's final features
        ``[..., hidden]``: the distribution training distils."""
        return torch.nn.functional.linear(features, self._borrowed["lm_weight"]).float()

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    # ---- persistence ---------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (fc.*, layers.0.*, d2t/t2d when reduced)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "eagle_format": HEAD_FORMAT})
        (directory / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2, sort_keys=True))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: "Target") -> "EagleHead":
        """Load a head directory (safetensors only) and attach it to ``target``: ours, or an EAGLE-1 / EAGLE-3
        head in the SafeAILab / vLLM / SGLang / speculators layout (``eagle.formats``). An EAGLE-3 checkpoint
        without its own ``lm_head`` (SGLang's "load it from the target") gets the target's rows."""
        from eagle import formats

        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if config_path.is_file() and not formats.is_native(directory):  # a SafeAILab / vLLM / SGLang / speculators layout
            config, state = formats.read_foreign(directory, target_layers=int(target.config.num_hidden_layers))
        else:
            if not config_path.is_file() or not weights_path.is_file():
                raise EagleError(f"{directory} is not a head directory: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
            config = HeadConfig.read(directory)
            state = load_file(str(weights_path))
        check_compatible(config, target)  # before the head is allocated
        check_revision(str(directory), config.target_revision, target)
        head = cls(config).to(device=target.device, dtype=target.dtype)  # the file's values cast once, to the target's dtype
        missing, unexpected = head.load_state_dict(state, strict=False)
        from_target = head.eagle3 and missing == ["lm_head.weight"]
        if (missing and not from_target) or unexpected:
            raise EagleError(f"{directory}: missing keys {list(missing)[:5]}, unexpected keys {list(unexpected)[:5]}")
        head.attach(target)
        if from_target:
            head.copy_target_lm_head()
        return head


class LeanHead(nn.Module):
    """An attached ``EagleHead`` on the fast path: ``forward`` equals ``EagleHead.forward`` over a ``KVCache``
    written at explicit slots, and ``expand`` adds the draft distribution's top-k."""

    def __init__(self, head: EagleHead, max_positions: int) -> None:
        super().__init__()
        if "embed" not in head._borrowed:
            raise EagleError("head is not attached to a target: call head.attach(target)")
        config = head.config.transformers_config()
        self.head = head
        self.fc = head.fc
        self.eagle3 = head.eagle3
        self.hidden_size = head.config.hidden_size
        self.input_size = head.config.input_size
        if self.eagle3:
            norm_before_residual = head.config.norm_before_residual
            self.layers = nn.ModuleList(LeanEagle3Layer(layer, config, norm_before_residual) for layer in head.layers)
        else:
            self.layers = nn.ModuleList(LeanLayer(layer, config) for layer in head.layers)
        self.embed = head._borrowed["embed"]
        self.shape = AttentionShape.of(config)
        weight = head.fc.weight
        cos, sin = rope_tables(head.rotary_emb, config, max_positions, weight.dtype, weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def new_cache(self, capacity: int, rows: int = 1) -> KVCache:
        weight = self.fc.weight
        return KVCache(len(self.layers), self.shape, capacity, weight.dtype, weight.device, rows)

    def forward(
        self,
        features: torch.Tensor,  # [1, q, input_size or hidden]: the target's features, or the head's own output
        next_tokens: torch.Tensor,  # [1, q]: x_{j+1}
        positions: torch.Tensor,  # [1, q]
        slots: torch.Tensor,  # [q]
        mask: torch.Tensor,  # [1, 1, q, kv] bool
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> torch.Tensor:
        """The head's output ``[1, q, hidden]`` (``EagleHead.forward``)."""
        embeds = self.embed(next_tokens).to(features.dtype)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if self.eagle3:
            hidden = self.fc(features) if features.shape[-1] != self.hidden_size else features
            for layer, layer_keys, layer_values in zip(self.layers, keys, values):
                hidden = layer(hidden, cos, sin, slots, mask, layer_keys, layer_values, embeds=embeds)
            return hidden
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        for layer, layer_keys, layer_values in zip(self.layers, keys, values):
            hidden = layer(hidden, cos, sin, slots, mask, layer_keys, layer_values)
        return hidden

    def propose(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best next tokens under the head's draft distribution for predicted features
        ``[q, hidden]``: (log-probabilities ``[q, k]`` float32, target ids ``[q, k]``), best first."""
        top = torch.log_softmax(self.head.draft_logits(hidden), dim=-1).topk(k, dim=-1)
        return top.values, self.head.draft_to_target(top.indices)

    def expand(self, features, next_tokens, positions, slots, mask, keys, values, k: int):
        """One draft step: (predicted features ``[q, hidden]``, their ``k`` best children's log-probabilities
        and target ids ``[q, k]``)."""
        hidden = self.forward(features, next_tokens, positions, slots, mask, keys, values)[0]
        return (hidden, *self.propose(hidden, k))

    def expand_rows(self, features, next_tokens, positions, slots, mask, keys, values, k: int):
        """``expand`` over a batch (``eagle.batch``): predicted features ``[B, q, hidden]``, children's
        log-probabilities and target ids ``[B, q, k]``."""
        hidden = self.forward(features, next_tokens, positions, slots, mask, keys, values)
        batch, q = next_tokens.shape
        logp, ids = self.propose(hidden.reshape(batch * q, -1), k)
        return hidden, logp.reshape(batch, q, k), ids.reshape(batch, q, k)


def draft_vocab_from_counts(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """EAGLE-3's reduced draft vocabulary (arXiv 2503.01840, section 3): the ``size`` most frequent target
    tokens in a corpus, ``counts[i]`` being token i's count; ``always`` (e.g. the stop tokens) are kept
    whatever their count. Count over the whole training corpus: a vocabulary built from a few hundred
    answers misses 12-15% of MT-bench's tokens (../shared/STACK.md). Returns sorted target ids."""
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise EagleError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    forced = sorted({int(i) for i in always})
    if len(forced) > size:
        raise EagleError(f"draft vocabulary of {size} cannot hold the {len(forced)} always-kept tokens")
    score = counts.to(torch.float64).clone()
    score[forced] = float("inf")
    ranked = torch.argsort(-score, stable=True)  # by count; ties go to the smaller id
    return torch.sort(ranked[:size]).values


UNKNOWN_REVISION = "unknown"


def check_revision(head: str, trained_revision: str | None, target: "Target | tuple[str, str]") -> None:
    """The one rule for "was this head trained for this target": a head records the revision of the target
    it was trained on (``HeadConfig.target_revision``, the registry's ``target_revision`` tag), and runs
    only on a target of that revision. A head that records none (``None`` or ``"unknown"``: an untrained
    head, one made before the field existed) is not refused. Names are not compared: the revision is the
    content (a local copy of the same weights under another name fits). ``target`` is a ``Target`` or
    its (name, revision). Raises ``HeadMismatchError``."""
    name, revision = (target.name, target.revision) if not isinstance(target, tuple) else target
    if trained_revision in (None, "", UNKNOWN_REVISION) or trained_revision == revision:
        return
    raise HeadMismatchError(f"head {head} was trained for target revision {trained_revision}, not {name} revision {revision}")


# the head's one decoder layer may be at most this many times wider than a target layer (heads from other
# trainers widen the MLP); past it, a config.json is refused before any tensor is allocated
MAX_WIDTH_RATIO = 4
_WIDTH_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def check_compatible(config: HeadConfig, target: "Target") -> None:
    """Raise ``HeadMismatchError`` when a head cannot run on ``target``: its shapes differ from the target's,
    or its sizes are out of bounds (checked before the head is built, so a ``config.json`` with a huge
    ``intermediate_size`` fails here instead of allocating it)."""
    problems = []
    layer = config.layer_config if isinstance(config.layer_config, dict) else {}
    for key in _WIDTH_FIELDS:
        value, ours = layer.get(key), getattr(target.config, key, None)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            problems.append(f"layer_config.{key} must be a positive integer, got {value!r}")
        elif isinstance(ours, int) and value > MAX_WIDTH_RATIO * ours:
            problems.append(f"layer_config.{key} = {value} is over {MAX_WIDTH_RATIO}x the target's {ours}")
    if layer.get("num_hidden_layers", 1) != 1:
        problems.append(f"layer_config.num_hidden_layers must be 1, got {layer.get('num_hidden_layers')!r}")
    if layer.get("hidden_size", config.hidden_size) != config.hidden_size:
        problems.append(f"layer_config.hidden_size {layer.get('hidden_size')!r} != hidden_size {config.hidden_size}")
    if type(config.draft_vocab_size) is not int or not 1 <= config.draft_vocab_size <= config.vocab_size:
        problems.append(f"draft_vocab_size must be in [1, vocab_size], got {config.draft_vocab_size!r}")
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} != target's {target.vocab_size}")
    if config.model_type != target.config.model_type:
        problems.append(f"architecture {config.model_type!r} != target's {target.config.model_type!r}")
    if config.kind not in HEAD_KINDS:
        problems.append(f"head kind must be one of {', '.join(HEAD_KINDS)}, got {config.kind!r}")
    elif config.kind == "eagle3":
        layers = int(target.config.num_hidden_layers)
        aux = config.aux_layers
        if not isinstance(aux, list) or len(aux) != 3 or any(type(i) is not int or not 0 <= i < layers for i in aux):
            problems.append(f"aux_layers must be 3 layer indices in [0, {layers}), got {aux!r}")
    if problems:
        raise HeadMismatchError(
            f"head for {config.target_name!r} does not fit target {target.name!r}: " + "; ".join(problems)
        )
