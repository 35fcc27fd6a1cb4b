"""Head export to / import from the EAGLE-1 layouts of vLLM, SGLang and SafeAILab EAGLE (eagle.formats)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig
from eagle.formats import HeadFormatError, export_head
from heads import good_head
from tiny import tiny_target

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
    state = decoder._prefill(PROMPT, GenerationConfig().sampling, None)
    tree = decoder._draft(state)
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

    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    save_file({"midlayer.self_attn.q_proj.weight": torch.zeros(4, 8), "fc.weight": torch.zeros(32, 96), "d2t": torch.zeros(8, dtype=torch.long)}, str(eagle3 / "model.safetensors"))
    (eagle3 / "config.json").write_text(json.dumps({**target.config.to_dict(), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}))

    speculators = tmp_path / "speculators"
    speculators.mkdir()
    save_file({"fc.weight": torch.zeros(32, 96)}, str(speculators / "model.safetensors"))
    (speculators / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {"algorithm": "eagle3"}}))

    for directory, reason in ((pickled, "pickled weights"), (eagle3, "EAGLE-3"), (speculators, "speculators checkpoint")):
        with pytest.raises(HeadFormatError, match=reason):
            EagleHead.from_pretrained(directory, target)
    run = _cli("generate", "--target", "smollm2-135m", "--head", str(pickled), "--prompt", "hi", "--compile", "off")
    assert run.returncode == 2 and "pickled weights" in run.stderr and len(run.stderr.strip().splitlines()) == 1

