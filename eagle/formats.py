"""Head checkpoints in other projects' layouts: export ours to them, import theirs.

Owns: the one table of key renames between our head directory (``eagle.head``: ``config.json`` with
``format: eagle-head/1`` + ``model.safetensors``) and the EAGLE-1 layouts other engines load, the checks that
say when a head cannot be written in a layout (and why), and reading a foreign head directory into a
``HeadConfig`` and a state dict.

The EAGLE-1 layouts, as read in each project's source:

- ``vllm``: vLLM's ``eagle`` method (``vllm/model_executor/models/llama_eagle.py``, ``EagleLlamaForCausalLM``,
  vLLM 0.32). ``fc`` is built with ``bias=False``; layer 0's ``input_layernorm`` is ``nn.Identity``; the
  head drafts over the target's whole vocabulary (no ``d2t``); ``embed_tokens`` and ``lm_head`` are taken
  from the target when the checkpoint has none. ``config.json`` is the layer's transformers config with
  ``num_hidden_layers: 1``; vLLM wraps it in ``EAGLEConfig`` and prefixes the architecture with ``Eagle``
  (``vllm/transformers_utils/configs/eagle.py``). Only Llama layers are registered for it.
- ``sglang``: SGLang's ``LlamaForCausalLMEagle`` (``python/sglang/srt/models/llama_eagle.py``): the same keys,
  layer 0 without its input norm; ``fc`` is always built with a bias (``config.bias`` is not read), so a head
  without one is written with a zero ``fc.bias``; its embedding and LM head are replaced by the target's
  (``EAGLEWorker.set_embed_and_head``); ``architectures`` must name ``LlamaForCausalLMEagle`` (vLLM would
  rename that to a class it lacks, so one ``config.json`` cannot serve both).
- ``eagle``: SafeAILab EAGLE-1 (``eagle/model/cnets1.py``, ``ea_model.py``): the same keys; ``fc`` has a bias
  unless ``config.json`` says ``"bias": false``; layer 0 has no ``input_layernorm``.

All three feed fc with ``[embedding(x_{j+1}); feature_j]`` in that order, the feature being the target's
final-norm hidden state, as ours does. EAGLE-3 checkpoints (``midlayer.*``, ``fc`` over three target
layers, ``d2t``) and the ``speculators`` format (which since speculators 0.9 and in vLLM 0.32's
``transformers_utils/configs/speculators/algos.py`` describes only EAGLE-3 and later kinds) need an EAGLE-3
head kind, which this engine does not have yet: both are refused with that reason.

Weights are read from safetensors only; a directory with only ``pytorch_model.bin`` is refused (a pickle can
run code when loaded).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle.errors import EagleError
from eagle.head import CONFIG_NAME, HEAD_FORMAT, WEIGHTS_NAME, HeadConfig

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("vllm", "sglang", "eagle", "speculators")

# Our key -> the key in the EAGLE-1 layouts (vllm, sglang and SafeAILab share it). ``None``: not written.
# The decoder layer's own keys (``layers.0.self_attn.*``, ``layers.0.mlp.*``, ``layers.0.*_layernorm``) are
# transformers' names in both and pass through unchanged.
EAGLE1_RENAMES: dict[str, str | None] = {
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",
    "d2t": None,
    "t2d": None,
}
# Keys a foreign EAGLE-1 file may hold that we take from the target instead (borrowed, frozen).
BORROWED_KEYS = ("embed_tokens.weight", "lm_head.weight")
EAGLE3_MARKERS = ("midlayer.", "d2t")
ARCHITECTURES = {  # what each loader's registry calls an EAGLE-1 Llama head
    "vllm": "EagleLlamaForCausalLM",
    "sglang": "LlamaForCausalLMEagle",
    "eagle": "LlamaForCausalLM",
}
# the reverse of EAGLE1_RENAMES for the keys that are written
EAGLE1_IMPORTS = {theirs: ours for ours, theirs in EAGLE1_RENAMES.items() if theirs is not None}
PROVENANCE_KEY = "eagle_head"  # our fields kept in an exported config.json (target name / revision)


class HeadFormatError(EagleError):
    """A head cannot be written in, or read from, a layout; the message says why."""


# ---- export --------------------------------------------------------------------------------------------


def export_problems(config: HeadConfig, fmt: str) -> list[str]:
    """Why a head with ``config`` cannot be exported as ``fmt`` (empty: it can)."""
    if fmt not in EXPORT_FORMATS:
        return [f"unknown format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}"]
    if fmt == "speculators":
        return [
            "the speculators format (speculators 0.9, and vLLM's reader of it) describes EAGLE-3 heads; this is "
            "an EAGLE-1 head: export it --to vllm, sglang or eagle"
        ]
    problems = []
    if config.input_norm:
        problems.append(
            "its decoder layer applies an input norm, which the EAGLE-1 loaders of vLLM, SGLang and EAGLE replace "
            "by the identity; train it with input_norm false (the jobs' default, TrainConfig.input_norm)"
        )
    if fmt == "vllm" and config.fc_bias:
        problems.append("its fc has a bias, and vLLM's eagle method builds fc without one; train it with fc_bias false")
    if config.draft_vocab_size != config.vocab_size:
        problems.append(
            f"it drafts over a reduced vocabulary ({config.draft_vocab_size} of {config.vocab_size} tokens), and "
            "EAGLE-1 heads in these layouts draft over the whole vocabulary; train it with draft_vocab_size none"
        )
    if fmt == "vllm" and config.model_type != "llama":
        problems.append(f"vLLM's eagle method registers a Llama layer only (EagleLlamaForCausalLM); this head's layer is {config.model_type!r}")
    return problems


def export_head(source: str | Path, dest: str | Path, fmt: str) -> Path:
    """Write the head directory ``source`` (ours) into ``dest`` in layout ``fmt``; raises ``HeadFormatError``
    with every reason it cannot. ``dest`` is written beside itself and renamed into place, so a failed export
    leaves nothing half-written; an existing ``dest`` is refused."""
    source, dest = Path(source), Path(dest)
    if not is_native(source):
        raise HeadFormatError(f"{source} is not a head directory in this engine's layout ({CONFIG_NAME} with format {HEAD_FORMAT!r})")
    config = HeadConfig.read(source)
    problems = export_problems(config, fmt)
    if problems:
        raise HeadFormatError(f"cannot export {source} as {fmt}: " + "; ".join(problems))
    if dest.exists():
        raise HeadFormatError(f"{dest} already exists: export into a new directory")
    state = _load_safetensors(source / WEIGHTS_NAME)
    renamed = {}
    for key, tensor in state.items():
        new = EAGLE1_RENAMES.get(key, key)
        if new is not None:
            renamed[new] = tensor.contiguous()
    if fmt == "sglang" and "fc.bias" not in renamed:  # SGLang builds fc with a bias whatever the config says
        renamed["fc.bias"] = torch.zeros(config.hidden_size, dtype=renamed["fc.weight"].dtype)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        save_file(renamed, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(_foreign_config(config, fmt, state), indent=2, sort_keys=True) + "\n")
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s as %s to %s (%d tensors)", source, fmt, dest, len(renamed))
    return dest


def _foreign_config(config: HeadConfig, fmt: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    layer = dict(config.layer_config)
    layer.update(
        model_type=config.model_type,
        architectures=[ARCHITECTURES[fmt]],
        num_hidden_layers=1,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        torch_dtype=str(state["fc.weight"].dtype).removeprefix("torch."),
    )
    layer["bias"] = config.fc_bias or fmt == "sglang"  # SafeAILab EAGLE reads fc's bias from here (default true)
    if fmt == "sglang":
        layer["tie_word_embeddings"] = False  # SGLang ties the head's lm_head to its embedding otherwise
    layer[PROVENANCE_KEY] = {"target_name": config.target_name, "target_revision": config.target_revision, "format": HEAD_FORMAT}
    return layer


# ---- import --------------------------------------------------------------------------------------------


def is_native(directory: str | Path) -> bool:
    """Whether ``directory`` holds a head in our own layout (``config.json`` saying ``format: eagle-head/1``)."""
    path = Path(directory) / CONFIG_NAME
    try:
        return json.loads(path.read_text()).get("format") == HEAD_FORMAT
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def read_foreign(directory: str | Path) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """A SafeAILab / vLLM / SGLang EAGLE-1 head directory as our ``HeadConfig`` and state dict (the layer's
    keys unchanged, borrowed keys dropped). Raises ``HeadFormatError`` for pickled weights, EAGLE-3 or
    speculators checkpoints and anything that is not a one-layer EAGLE-1 head."""
    directory = Path(directory)
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise HeadFormatError(f"{directory} is not a head directory: it has no {CONFIG_NAME}")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise HeadFormatError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise HeadFormatError(f"{config_path} is not a JSON object")
    if "layer_config" in raw:  # one of ours, of another format version
        raise HeadFormatError(f"{config_path}: unsupported head format {raw.get('format')!r} (expected {HEAD_FORMAT!r})")
    if "speculators_model_type" in raw or "speculators_config" in raw:
        raise HeadFormatError(
            f"{directory} is a speculators checkpoint ({raw.get('speculators_model_type', '?')}); this engine runs "
            "EAGLE-1 heads only and has no EAGLE-3 head kind yet"
        )
    state = _load_weights(directory)
    if any(key.startswith(EAGLE3_MARKERS) for key in state) or "eagle_config" in raw:
        raise HeadFormatError(f"{directory} is an EAGLE-3 head (midlayer / d2t / eagle_config); this engine has no EAGLE-3 head kind yet")
    for key in BORROWED_KEYS:
        if state.pop(key, None) is not None:
            logger.info("%s: ignoring %s (the target's own is used)", directory, key)
    if "fc.weight" not in state:
        raise HeadFormatError(f"{directory} is not an EAGLE-1 head: its weights have no fc.weight")
    state = {EAGLE1_IMPORTS.get(key, key): tensor for key, tensor in state.items()}
    hidden = int(raw.get("hidden_size", state["fc.weight"].shape[0]))
    if tuple(state["fc.weight"].shape) != (hidden, 2 * hidden):
        raise HeadFormatError(f"{directory}: fc.weight is {tuple(state['fc.weight'].shape)}, an EAGLE-1 fc is ({hidden}, {2 * hidden})")
    if "model_type" not in raw or "vocab_size" not in raw:
        raise HeadFormatError(f"{config_path} needs model_type and vocab_size")
    provenance = raw.get(PROVENANCE_KEY) if isinstance(raw.get(PROVENANCE_KEY), dict) else {}
    layer = {k: v for k, v in raw.items() if k not in ("architectures", "bias", PROVENANCE_KEY, "torch_dtype", "dtype", "auto_map")}
    layer["num_hidden_layers"] = raw.get("num_hidden_layers", 1)
    config = HeadConfig(
        hidden_size=hidden,
        vocab_size=int(raw["vocab_size"]),
        draft_vocab_size=int(raw["vocab_size"]),
        model_type=str(raw["model_type"]),
        layer_config=layer,
        target_name=str(provenance.get("target_name", "unknown")),
        target_revision=str(provenance.get("target_revision", "unknown")),
        fc_bias="fc.bias" in state,
        input_norm="layers.0.input_layernorm.weight" in state,
        extra={"imported_from": str(raw.get("architectures", ["?"])[0])},
    )
    return config, state


# ---- files ---------------------------------------------------------------------------------------------


def weights_files(directory: str | Path) -> list[Path]:
    """A head directory's weight files: ``model.safetensors``, else every ``*.safetensors`` of a sharded
    checkpoint. Raises ``HeadFormatError`` (before any tensor is read) when there are none, naming pickled
    weights when that is what the directory holds."""
    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file():
        raise HeadFormatError(f"{directory} is not a head directory: it has no {CONFIG_NAME}")
    files = [directory / WEIGHTS_NAME] if (directory / WEIGHTS_NAME).is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
            raise HeadFormatError(f"{directory} holds pickled weights (pytorch_model.bin), which are never loaded: convert them to safetensors")
        raise HeadFormatError(f"{directory} has no *.safetensors weights")
    return files


def _load_weights(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weights_files(directory):
        state.update(_load_safetensors(path))
    return state


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise HeadFormatError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise HeadFormatError(f"{path} is not a readable safetensors file: {type(err).__name__}") from None
