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
final-norm hidden state, as ours does.

The EAGLE-3 layouts (``HeadConfig.kind == "eagle3"``), as read in each project's source. All four build the
layer ours builds (``eagle.head``): fc(3h -> h, no bias) over the target layers' streams, attention over
``[input_layernorm(embedding); hidden_norm(feature)]``, the residual the feature itself unless
``norm_before_residual``, a final ``norm`` and a draft ``lm_head`` (draft vocabulary x h) of their own, ``d2t``
(draft id -> target id offset) and ``t2d``; none reads an ``embed_tokens`` it is not given.

- ``vllm``: vLLM 0.32's ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``; registered for ``architectures``
  ``LlamaForCausalLMEagle3``). Keys ``layers.0.*`` or ``midlayer.*`` (renamed to ``layers.0.``), ``fc.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t`` (needed when the draft vocabulary is smaller; ``t2d`` is
  skipped). ``config.json``: a Llama config with ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual`` (absent: false) and ``eagle_aux_hidden_state_layer_ids``, the target layers whose
  *inputs* it captures (``EagleModelMixin._maybe_add_hidden_state``: index i = the stream entering layer i,
  ours), which the model runner sorts and de-duplicates (``tuple(sorted(set(layers)))``): exported ids must
  be strictly increasing. Absent, vLLM takes (2, L//2, L-3).
- ``sglang``: SGLang's ``LlamaForCausalLMEagle3`` (``llama_eagle3.py``): keys ``midlayer.*`` (``layers.0.*``
  match no parameter and are skipped without a word, so the export renames them), fc's bias from
  ``config.bias`` (false), ``tie_word_embeddings`` must be false (true makes its lm_head the embedding), the
  residual always the un-normed feature (no ``norm_before_residual``). Its targets capture (2, L//2, L-3) by
  default; explicit ids are shifted by one against vLLM's (``set_eagle3_layers_to_capture`` adds 1: id i
  is the *output* of layer i), so only heads on the default layers are exported, with no ids written.
- ``eagle``: SafeAILab EAGLE-3 (``eagle/model/cnets.py``): keys ``midlayer.*``, ``fc.weight``, ``norm.weight``,
  ``lm_head.weight``, ``d2t``, ``t2d``; ``draft_vocab_size`` in ``config.json``; the target layers are fixed
  in its target code to (2, L//2, L-3) and the residual is the un-normed feature.
- ``speculators``: speculators 0.9's ``Eagle3DraftModel`` / ``Eagle3SpeculatorConfig``
  (``speculators/models/eagle3``): keys ``layers.0.*`` (with ``hidden_norm``), ``fc.weight``, ``norm.weight``,
  ``lm_head.weight``, ``d2t``, ``t2d``; ``config.json`` with ``speculators_model_type: eagle3``,
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (a greedy proposal, the verifier).
  ``norm_before_residual`` is always written: speculators defaults it to false, while vLLM's reader of this
  format (``transformers_utils/configs/speculators/algos.py``) assumes true when it is absent.

Importing reads all of these (and SpecForge's, which is SGLang's layout) into an ``eagle3`` head: the layer
ids of a config that names none are the default for the target it is loaded on.

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
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle.errors import EagleError
from eagle.head import CONFIG_NAME, HEAD_FORMAT, WEIGHTS_NAME, HeadConfig

if TYPE_CHECKING:
    from eagle.target import Target

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
# Our key prefix -> the prefix in each EAGLE-3 layout (the rest of a key is transformers' name in all of them).
EAGLE3_RENAMES: dict[str, dict[str, str]] = {
    "vllm": {"layers.0.": "layers.0."},
    "speculators": {"layers.0.": "layers.0."},
    "sglang": {"layers.0.": "midlayer."},
    "eagle": {"layers.0.": "midlayer."},
}
# Keys a foreign file may hold that we take from the target instead (borrowed, frozen); an EAGLE-3 head keeps
# its own lm_head.
BORROWED_KEYS = ("embed_tokens.weight", "lm_head.weight")
EAGLE3_MARKERS = ("midlayer.", "d2t", "layers.0.hidden_norm.")
ARCHITECTURES = {  # what each loader's registry calls an EAGLE-1 Llama head
    "vllm": "EagleLlamaForCausalLM",
    "sglang": "LlamaForCausalLMEagle",
    "eagle": "LlamaForCausalLM",
}
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's, SGLang's and SafeAILab's name for an EAGLE-3 Llama head
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose Eagle3SpeculatorConfig the export is written for
VERIFIER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# EAGLE-3 variants of other trainers that this engine's layer does not build: refused on import
UNSUPPORTED_EAGLE3_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
# the reverse of EAGLE1_RENAMES for the keys that are written
EAGLE1_IMPORTS = {theirs: ours for ours, theirs in EAGLE1_RENAMES.items() if theirs is not None}
PROVENANCE_KEY = "eagle_head"  # our fields kept in an exported config.json (target name / revision)


class HeadFormatError(EagleError):
    """A head cannot be written in, or read from, a layout; the message says why."""


# ---- export --------------------------------------------------------------------------------------------


def _default_layers(aux: list[int]) -> bool:
    """Whether ``aux`` is EAGLE-3's default (2, L//2, L-3) for some target depth L (>= 6, unclamped)."""
    from eagle.head import default_aux_layers

    return len(aux) == 3 and aux[2] >= 3 and aux[2] + 3 >= 6 and list(default_aux_layers(aux[2] + 3)) == list(aux)


def export_problems(config: HeadConfig, fmt: str) -> list[str]:
    """Why a head with ``config`` cannot be exported as ``fmt`` (empty: it can)."""
    if fmt not in EXPORT_FORMATS:
        return [f"unknown format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}"]
    if config.kind == "eagle3":
        return _eagle3_export_problems(config, fmt)
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


def _eagle3_export_problems(config: HeadConfig, fmt: str) -> list[str]:
    problems = []
    aux = list(config.aux_layers or [])
    if fmt in ("vllm", "speculators") and any(b <= a for a, b in zip(aux, aux[1:])):
        problems.append(f"its target layers {aux} are not strictly increasing, and {fmt} concatenates them sorted and de-duplicated")
    if fmt in ("sglang", "eagle") and not _default_layers(aux):
        problems.append(
            f"it reads target layers {aux}, and {fmt} captures the default (2, L//2, L-3) only "
            "(SGLang's explicit ids mean other layers than vLLM's; SafeAILab's are fixed)"
        )
    if fmt in ("sglang", "eagle") and config.norm_before_residual:
        problems.append(f"its layer adds to the normed feature (norm_before_residual), which {fmt} does not build")
    if fmt in ("vllm", "sglang", "eagle") and config.model_type != "llama":
        problems.append(f"{fmt}'s EAGLE-3 layout ({EAGLE3_ARCHITECTURE}) is a Llama layer; this head's layer is {config.model_type!r}")
    if fmt == "speculators" and config.model_type not in ("llama", "qwen3"):
        problems.append(f"speculators 0.9 builds EAGLE-3 layers for llama and qwen3 only; this head's layer is {config.model_type!r}")
    return problems


def export_head(source: str | Path, dest: str | Path, fmt: str, *, verifier: str | None = None, target: "Target | None" = None) -> Path:
    """Write the head directory ``source`` (ours) into ``dest`` in layout ``fmt``; raises ``HeadFormatError``
    with every reason it cannot. ``dest`` is written beside itself and renamed into place, so a failed export
    leaves nothing half-written; an existing ``dest`` is refused. ``verifier`` (speculators only): the target's
    Hugging Face id or directory, which speculators loads the head with (default: the head's target as this
    machine resolves it).

    An EAGLE-3 file saved without its ``lm_head.weight`` (the target's draft-vocabulary rows, frozen:
    ``EagleHead.from_pretrained`` restores them) gets them back from ``target`` (default: the head's target,
    loaded): every layout written here carries the draft LM head, since vLLM, finding none, shares the
    target's whole-vocabulary LM head and maps its ids through ``d2t`` as draft ids (seen 2026-12-04: 0 of
    1,016 drafts accepted)."""
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
    if config.kind == "eagle3":
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = _target_draft_rows(source, config, state["fc.weight"].dtype, target)
        renamed, foreign_config = _eagle3_export(config, fmt, state, _verifier(config, verifier) if fmt == "speculators" else None)
    else:
        renamed = {}
        for key, tensor in state.items():
            new = EAGLE1_RENAMES.get(key, key)
            if new is not None:
                renamed[new] = tensor.contiguous()
        if fmt == "sglang" and "fc.bias" not in renamed:  # SGLang builds fc with a bias whatever the config says
            renamed["fc.bias"] = torch.zeros(config.hidden_size, dtype=renamed["fc.weight"].dtype)
        foreign_config = _foreign_config(config, fmt, state)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        save_file(renamed, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        (staging / CONFIG_NAME).write_text(json.dumps(foreign_config, indent=2, sort_keys=True) + "\n")
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s as %s to %s (%d tensors)", source, fmt, dest, len(renamed))
    return dest


def _target_draft_rows(source: Path, config: HeadConfig, dtype: torch.dtype, target: "Target | None") -> torch.Tensor:
    """An EAGLE-3 head's frozen ``lm_head`` rows (the target's draft-vocabulary rows) as
    ``EagleHead.from_pretrained`` restores them, in ``dtype``."""
    from eagle.head import EagleHead
    from eagle.target import load_target

    if target is None:
        target = _of_the_heads_target(config, load_target, "the head's file has no lm_head.weight, and the export needs the target's LM head rows")
    return EagleHead.from_pretrained(source, target).lm_head.weight.detach().to(device="cpu", dtype=dtype).contiguous()


def _of_the_heads_target(config: HeadConfig, resolve: Callable[[str], T], need: str) -> T:
    """``resolve(config.target_name)``: what an export reads from the head's target (its weights, its path),
    or a ``HeadFormatError`` saying what the export needs (``need``) when that name does not resolve here."""
    from eagle.errors import UnknownTargetError

    try:
        return resolve(config.target_name)
    except UnknownTargetError:
        raise HeadFormatError(f"the head's target {config.target_name!r} does not resolve here: {need}") from None


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


def _verifier(config: HeadConfig, given: str | None) -> str:
    """What a speculators config names as the verifier: speculators 0.9's ``Eagle3DraftModel.from_pretrained``
    reads its config (``load_verifier_weights``) whatever the checkpoint holds, so it must resolve."""
    if given:
        return given
    from eagle.target import resolve_target

    return str(_of_the_heads_target(config, resolve_target, "pass --verifier with its Hugging Face id or directory")[0])


def _eagle3_export(config: HeadConfig, fmt: str, state: dict[str, torch.Tensor], verifier: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, config.json) of an eagle3 head in layout ``fmt``."""
    (ours, theirs), = EAGLE3_RENAMES[fmt].items()
    tensors = {(theirs + key[len(ours):] if key.startswith(ours) else key): t.contiguous() for key, t in state.items()}
    if "d2t" not in tensors and fmt == "eagle":  # a full-vocabulary head: SafeAILab's d2t / t2d buffers hold the identity
        # (vLLM has no d2t parameter for a full vocabulary and would refuse one)
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    dtype = str(state["fc.weight"].dtype).removeprefix("torch.")
    layer = dict(config.layer_config)
    layer.update(model_type=config.model_type, num_hidden_layers=1, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                 tie_word_embeddings=False)
    for key in ("architectures", "torch_dtype", "dtype", "bias"):
        layer.pop(key, None)
    provenance = {"target_name": config.target_name, "target_revision": config.target_revision, "format": HEAD_FORMAT,
                  "kind": config.kind, "aux_layers": list(config.aux_layers or [])}
    eagle3 = {"draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.hidden_size,
              "norm_before_residual": config.norm_before_residual}
    if fmt == "speculators":
        written = {
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            **eagle3,
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layers or []),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": [VERIFIER_ARCHITECTURES.get(config.model_type, "LlamaForCausalLM")]},
            },
            "torch_dtype": dtype,
            PROVENANCE_KEY: provenance,
        }
        return tensors, written
    written = {**layer, **eagle3, "architectures": [EAGLE3_ARCHITECTURE], "bias": False, "torch_dtype": dtype, PROVENANCE_KEY: provenance}
    if fmt == "vllm":
        written["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layers or [])
    if fmt in ("sglang", "eagle"):
        written.pop("norm_before_residual")  # neither reads it: both add to the un-normed feature
    return tensors, written


# ---- import --------------------------------------------------------------------------------------------


def is_native(directory: str | Path) -> bool:
    """Whether ``directory`` holds a head in our own layout (``config.json`` saying ``format: eagle-head/1``)."""
    path = Path(directory) / CONFIG_NAME
    try:
        return json.loads(path.read_text()).get("format") == HEAD_FORMAT
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def read_foreign(directory: str | Path, target_layers: int | None = None) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """A SafeAILab / vLLM / SGLang head directory (EAGLE-1 or EAGLE-3; speculators and SpecForge EAGLE-3) as
    our ``HeadConfig`` and state dict (the layer's keys in our names, borrowed keys dropped). An EAGLE-3
    config that names no target layers gets the default for a target of ``target_layers`` layers. Raises
    ``HeadFormatError`` for pickled weights and anything that is not a one-layer head of a kind we build."""
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
        if raw.get("speculators_model_type") != "eagle3":
            raise HeadFormatError(f"{directory} is a speculators {raw.get('speculators_model_type', '?')!r} checkpoint; only its eagle3 kind is read")
        return _read_eagle3(directory, raw, _load_weights(directory), target_layers, speculators=True)
    state = _load_weights(directory)
    if any(key.startswith(EAGLE3_MARKERS) for key in state) or "eagle_config" in raw or "draft_vocab_size" in raw:
        return _read_eagle3(directory, raw, state, target_layers, speculators=False)
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


def _read_eagle3(directory: Path, raw: dict, state: dict[str, torch.Tensor], target_layers: int | None, *, speculators: bool) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    from eagle.head import default_aux_layers

    layer_raw = raw.get("transformer_layer_config") if speculators else raw
    if not isinstance(layer_raw, dict):
        raise HeadFormatError(f"{directory}: transformer_layer_config must be a JSON object")
    eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    flags = [flag for flag in UNSUPPORTED_EAGLE3_FLAGS if raw.get(flag) or eagle_config.get(flag)]
    if flags:
        raise HeadFormatError(f"{directory} is an EAGLE-3 variant ({', '.join(flags)}) that this engine's layer does not build")
    if eagle_config.get("use_aux_hidden_state") is False:
        raise HeadFormatError(f"{directory} is an EAGLE-3 head without fused target layers (use_aux_hidden_state false)")
    if int(layer_raw.get("num_hidden_layers", 1)) != 1:
        raise HeadFormatError(f"{directory} has {layer_raw.get('num_hidden_layers')} decoder layers; this engine's heads have one")
    for key in [k for k in state if k.startswith("model.")]:  # a checkpoint saved from the whole draft model
        state[key[len("model."):]] = state.pop(key)
    for key in [k for k in state if k.startswith("midlayer.")]:
        state["layers.0." + key[len("midlayer."):]] = state.pop(key)
    if state.pop("embed_tokens.weight", None) is not None:
        logger.info("%s: ignoring embed_tokens.weight (the target's own is used)", directory)
    if "fc.weight" not in state or "layers.0.hidden_norm.weight" not in state:
        raise HeadFormatError(f"{directory} is not an EAGLE-3 head: its weights need fc.weight and midlayer / layers.0 hidden_norm")
    hidden = int(layer_raw.get("hidden_size", state["fc.weight"].shape[0]))
    target_hidden = int(raw.get("target_hidden_size") or hidden)
    if target_hidden != hidden:
        raise HeadFormatError(f"{directory}: a head {hidden} wide on a target {target_hidden} wide is not built here")
    if tuple(state["fc.weight"].shape) != (hidden, 3 * hidden):
        raise HeadFormatError(f"{directory}: fc.weight is {tuple(state['fc.weight'].shape)}, an EAGLE-3 fc over three layers is ({hidden}, {3 * hidden})")
    if "model_type" not in layer_raw or "vocab_size" not in layer_raw:
        raise HeadFormatError(f"{directory}: its config needs model_type and vocab_size")
    vocab = int(layer_raw["vocab_size"])
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if draft_vocab != vocab and "d2t" not in state:
        raise HeadFormatError(f"{directory}: a {draft_vocab}-token draft vocabulary needs d2t")
    if draft_vocab == vocab:
        state.pop("d2t", None), state.pop("t2d", None)
    elif "t2d" not in state:  # vLLM and SGLang never read t2d; it follows from d2t
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + state["d2t"].long()] = True
        state["t2d"] = t2d
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        if target_layers is None:
            raise HeadFormatError(f"{directory} names no target layers; load it on a target to take that target's default")
        aux = list(default_aux_layers(target_layers))
    if not isinstance(aux, list) or len(aux) != 3 or not all(type(i) is int for i in aux):
        raise HeadFormatError(f"{directory}: eagle_aux_hidden_state_layer_ids must be 3 layer indices, got {aux!r}")
    provenance = raw.get(PROVENANCE_KEY) if isinstance(raw.get(PROVENANCE_KEY), dict) else {}
    layer = {k: v for k, v in layer_raw.items() if k not in ("architectures", "bias", PROVENANCE_KEY, "torch_dtype", "dtype", "auto_map",
                                                              "draft_vocab_size", "target_hidden_size", "eagle_config",
                                                              "eagle_aux_hidden_state_layer_ids", "norm_before_residual")}
    layer["num_hidden_layers"] = 1
    architecture = (raw.get("architectures") or ["?"])[0]
    config = HeadConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        model_type=str(layer_raw["model_type"]),
        layer_config=layer,
        target_name=str(provenance.get("target_name", "unknown")),
        target_revision=str(provenance.get("target_revision", "unknown")),
        fc_bias=False,
        input_norm=True,
        kind="eagle3",
        aux_layers=aux,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        extra={"imported_from": f"speculators {architecture}" if speculators else str(architecture)},
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
