"""The frozen target partitioned with DeepSpeed ZeRO-3: loading it, the backbone-only forward that yields
EAGLE's features (and EAGLE-3's low/mid/high layers), and what each rank holds.

Used by ``jobs.featurize`` (the feature stage) and by ``jobs.train_head`` in online mode, where the frozen target
lives in the training workers as a :class:`ShardedTarget`.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn

from eagle.errors import EagleError
from eagle.target import Target, adapter_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FeatureExtractor(nn.Module):
    """Wraps a Hugging Face causal LM; ``forward`` runs only its backbone (no LM-head logits) and returns
    ``(features [b, q, h], aux [b, q, 3h] | None)``.

    The whole causal LM stays a submodule, so under ZeRO-3 its embedding and LM head are partitioned like
    everything else (gather them with ``deepspeed.zero.GatheredParameters`` when a trainer needs them).
    Calling the wrapper (or the DeepSpeed engine around it) rather than ``lm.model`` directly matters: ZeRO-3
    resets its parameter-fetch trace in a pre-forward hook on the root module it was given.
    """

    def __init__(self, lm: nn.Module, aux_layers: Sequence[int] | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.aux_layers = tuple(aux_layers) if aux_layers else ()
        self._captured: dict[int, torch.Tensor] = {}
        backbone = self.backbone
        for index in sorted(set(self.aux_layers)):
            backbone.layers[index].register_forward_pre_hook(self._capture_hook(index), with_kwargs=True)

    @property
    def backbone(self) -> nn.Module:
        return self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model

    def _capture_hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self._captured[index] = hidden
            return None

        return hook

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        self._captured.clear()
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = None
        if self.aux_layers:
            aux = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
            self._captured.clear()
        return out.last_hidden_state, aux


def zero3_config(dtype: str, *, stage: int = 3, persistence_threshold: int | None = None) -> dict[str, Any]:
    """A DeepSpeed config for a frozen (inference-only) model: ZeRO stage ``stage``, no optimizer; the
    parameter dtype comes from the ``bf16``/``fp16`` sections (fp32 when neither is enabled)."""
    zero: dict[str, Any] = {"stage": stage}
    if persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def load_frozen_target_zero3(
    hf_dir: str | os.PathLike,
    dtype: str,
    ds_config: dict[str, Any] | None = None,
    *,
    aux_layers: Sequence[int] | None = None,
    device: torch.device | str | None = None,
):
    """Load a causal LM from ``hf_dir`` frozen and partitioned across the current process group with
    DeepSpeed ZeRO-3; return the DeepSpeed engine around a :class:`FeatureExtractor`.

    ``torch.distributed`` must already be initialised (Ray Train's ``TorchConfig`` does it). How the load
    stays partitioned with transformers 5.x: while an ``HfDeepSpeedConfig`` with stage 3 is alive,
    ``is_deepspeed_zero3_enabled()`` is true, so ``from_pretrained`` constructs the model inside
    ``deepspeed.zero.Init`` (every parameter is split into 1/N ``ds_tensor`` partitions as it is created)
    and copies the checkpoint in module by module: rank 0 reads the safetensors, the others only see
    shapes (``meta``), each module is gathered, written on rank 0 and re-partitioned. ``deepspeed.initialize``
    with stage 3 and no optimizer then installs the fetch/release hooks (``DeepSpeedZeRoOffload``) that
    all-gather a module's weights just before its forward and free them after. ``deepspeed.init_inference``
    cannot do this (it replicates or tensor-slices, never ZeRO-3 partitions).

    With ``ds_config["zero_optimization"]["stage"] == 0`` the model is loaded whole on every rank (plain
    data parallel, no DeepSpeed), which suits targets that fit one device.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise EagleError(f"unknown feature dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    ds_config = ds_config or zero3_config(dtype)
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    kwargs = dict(dtype=DTYPES[dtype], local_files_only=True, use_safetensors=True, attn_implementation="sdpa")
    if stage == 0:
        lm = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
        lm.requires_grad_(False)
        module = FeatureExtractor(lm.eval(), aux_layers)
        return module.to(device) if device is not None else module
    if stage != 3:
        raise EagleError(f"a frozen target is partitioned with ZeRO stage 3 (or replicated with 0), not {stage}")

    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    # transformers keeps only a weak reference: this object must stay alive through from_pretrained.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    try:
        lm = AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del hf_ds_config
    lm.requires_grad_(False)
    module = FeatureExtractor(lm.eval(), aux_layers)
    engine, *_ = deepspeed.initialize(model=module, config=ds_config)
    engine.eval()
    return engine


def partition_numel(module: nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the full model) for a ZeRO-3 module (or a plain one)."""
    local = total = 0
    for parameter in module.parameters():
        if hasattr(parameter, "ds_tensor"):
            local += int(parameter.ds_tensor.numel())
            total += int(parameter.ds_numel)
        else:
            local += parameter.numel()
            total += parameter.numel()
    return local, total


def resident_numel(module: nn.Module) -> int:
    """Parameter elements this rank holds in memory right now: a ZeRO-3 parameter's own partition plus its
    full tensor while it is gathered (a parameter under ``stage3_param_persistence_threshold`` stays gathered
    after the forward that fetched it; the others are released to an empty tensor), a plain parameter whole.
    Measured after forward passes, this is what the partitioning saves, not what the load-time metadata says."""
    resident = 0
    for parameter in module.parameters():
        if hasattr(parameter, "ds_tensor"):
            resident += int(parameter.ds_tensor.numel()) + int(parameter.data.numel())
        else:
            resident += parameter.numel()
    return resident


class ShardedTarget(Target):
    """A frozen target partitioned across the ranks with ZeRO-3 (:func:`load_frozen_target_zero3`), seen as an
    ``eagle.target.Target`` by the trainer: ``features`` runs the partitioned backbone (a collective: every
    rank must call it the same number of times), while the embedding and LM head that the head borrows are
    gathered once and kept whole on every rank (vocab x hidden each). No rank ever holds the decoder layers
    whole.
    """

    def __init__(self, engine, tokenizer, *, name: str, revision: str) -> None:  # noqa: D107 (Target's fields, set here)
        import deepspeed

        self.engine = engine
        root = engine.module if hasattr(engine, "module") else engine
        lm = root.lm
        self.model = lm
        self.tokenizer = tokenizer
        self.name, self.revision = name, revision
        self.config = lm.config
        self.adapter = adapter_for(self.config)
        self.backbone = None  # partitioned: run it through ``features``
        embed, head = lm.get_input_embeddings(), lm.get_output_embeddings()
        borrowed = list({id(p): p for p in (embed.weight, head.weight)}.values())  # one when tied
        with deepspeed.zero.GatheredParameters(borrowed):  # a collective; a no-op for a replicated (stage 0) model
            embed_weight = embed.weight.detach().clone()
            head_weight = embed_weight if len(borrowed) == 1 else head.weight.detach().clone()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.lm_head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False, device=head_weight.device, dtype=head_weight.dtype)
        self.lm_head.weight = self.embed_tokens.weight if len(borrowed) == 1 else nn.Parameter(head_weight, requires_grad=False)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(head_weight.shape[0])
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states ``[b, q, hidden]`` for ``input_ids`` ``[b, q]`` (right padding is harmless:
        attention is causal)."""
        return self.hidden(input_ids)[0]

    def hidden(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final features ``[b, q, hidden]``, the ``aux_layers``' input streams ``[b, q, 3 x hidden]`` or None
        when loaded without them)."""
        with torch.no_grad():
            return self.engine(input_ids)

    def numel(self) -> int:
        """Parameter elements of the whole target (the sum over ranks of what ZeRO-3 partitioned)."""
        return partition_numel(self.engine.module if hasattr(self.engine, "module") else self.engine)[1]

    def resident_numel(self) -> int:
        """Elements of the partitioned target this rank holds now: its partitions and anything still gathered
        (the borrowed copies are counted by :meth:`borrowed_numel`)."""
        return resident_numel(self.engine.module if hasattr(self.engine, "module") else self.engine)

    def borrowed_numel(self) -> int:
        """Elements of the whole embedding and LM head every rank keeps for the head (one matrix when tied)."""
        tied = self.lm_head.weight is self.embed_tokens.weight
        return self.embed_tokens.weight.numel() + (0 if tied else self.lm_head.weight.numel())


def load_sharded_target(
    spec: str, dtype: str, *, device: torch.device | str | None = None, persistence_threshold: int | None = None,
    aux_layers: Sequence[int] | None = None,
) -> ShardedTarget:
    """``spec`` (a built-in name or a local HF directory) loaded frozen and ZeRO-3 partitioned across the
    current process group, its forward also returning the ``aux_layers``' input streams (an EAGLE-3 head's
    input); every rank must call it."""
    from transformers import AutoTokenizer

    from eagle.target import resolve_target

    directory, name, revision = resolve_target(spec)
    engine = load_frozen_target_zero3(
        directory, dtype, zero3_config(dtype, persistence_threshold=persistence_threshold), aux_layers=aux_layers, device=device
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return ShardedTarget(engine, tokenizer, name=name, revision=revision)
