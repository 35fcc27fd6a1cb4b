"""Greedy losslessness on the real default target (SmolLM2-135M-Instruct, float32).

Three heads so that every branch of verification runs on the real model: an untrained head (mostly
rejections), a deliberately wrong head (drafts the target's *least* likely tokens: every draft rejected),
and a "copy" head (predicts that the next feature equals the current one, so it drafts the root token
again and again) on a prompt whose continuation repeats one token: full-depth acceptances.
"""

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree


TREES = [StaticTree(), DynamicTree(), DynamicTree(depth=6, top_k=8, total_tokens=48)]
REPEATING_PROMPT = "----------------------------------------"  # SmolLM2 continues "-1000000000..."


def copy_head(target) -> EagleHead:
    head = EagleHead.for_target(target, seed=0)
    hidden = target.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)  # output = the input feature
        head.fc.bias.zero_()
        head.layers[0].self_attn.o_proj.weight.zero_()  # decoder layer reduced to its residual path
        head.layers[0].mlp.down_proj.weight.zero_()
    return head


def wrong_head(target) -> EagleHead:
    head = copy_head(target)
    with torch.no_grad():
        head.fc.weight[:, target.hidden_size :] *= -1  # logits negated: the least likely tokens first
    return head


CHAT_PROMPT = "Write a Python function that checks whether a string is a palindrome."
# (head, tree, prompt) cases: each head on the prompt where its branch of verification happens.
CASES = [
    pytest.param("untrained", "static", "chat", marks=pytest.mark.nightly),
    ("untrained", "dynamic", "chat"),
    pytest.param("wrong", "dynamic", "chat", marks=pytest.mark.nightly),
    pytest.param("copy", "static", "repeat", marks=pytest.mark.nightly),
    ("copy", "dynamic", "repeat"),
    pytest.param("copy", "dynamic-wide", "repeat", marks=pytest.mark.nightly),
]
TREE_BY_NAME = dict(zip(["static", "dynamic", "dynamic-wide"], TREES))


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    config = GenerationConfig(max_new_tokens=32)
    prompts = {"chat": smollm2.encode(CHAT_PROMPT, chat=True), "repeat": smollm2.encode(REPEATING_PROMPT)}
    return config, {name: (ids, Decoder(smollm2).generate(ids, config).token_ids) for name, ids in prompts.items()}


@pytest.mark.parametrize("head_kind, tree_name, prompt_name", CASES)
def test_greedy_eagle_equals_plain_decoding(smollm2, plain_outputs, head_kind, tree_name, prompt_name):
    head = {"untrained": EagleHead.for_target, "wrong": wrong_head, "copy": copy_head}[head_kind](smollm2)
    tree = TREE_BY_NAME[tree_name]
    config, outputs = plain_outputs
    prompt_ids, plain_tokens = outputs[prompt_name]
    result = Decoder(smollm2, head, tree).generate(prompt_ids, config)
    assert result.token_ids == plain_tokens
    accepted = [s.accepted for s in result.steps]
    assert 0 in accepted  # rejections happen for every head
    if head_kind == "wrong":
        assert max(accepted) == 0
    if head_kind == "copy":
        assert max(accepted) == tree.depth  # whole root-to-leaf paths accepted


def test_hf_generate_agrees_with_our_plain_loop(smollm2, plain_outputs):
    config, outputs = plain_outputs
    for prompt_ids, plain_tokens in outputs.values():
        out = smollm2.model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=config.max_new_tokens, do_sample=False,
            eos_token_id=smollm2.eos_token_ids, pad_token_id=smollm2.eos_token_ids[0],
        )
        assert out[0, len(prompt_ids):].tolist() == plain_tokens


def test_stream_chunks_concatenate_to_generate(smollm2):
    head = copy_head(smollm2)
    ids = smollm2.encode(REPEATING_PROMPT)
    config = GenerationConfig(max_new_tokens=32)
    decoder = Decoder(smollm2, head, StaticTree())
    chunks = list(decoder.stream(ids, config))
    result = decoder.generate(ids, config)
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert chunks[0].stats is None and all(c.stats is not None for c in chunks[1:])


def test_two_cold_starts_convert_the_builtin_target_without_racing(tmp_path):
    """Two processes convert the GGUF at once into an empty cache (issue 13): both get the same complete
    folder and revision, and no temporary folder is left behind."""
    import json
    import os
    import subprocess
    import sys

    code = "import json; from eagle.target import materialize_builtin; d, r = materialize_builtin('smollm2-135m'); print(json.dumps([str(d), r]))"
    env = {**os.environ, "EAGLE_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0] == results[1]
    folder = tmp_path / "cache" / "targets"
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) == ["smollm2-135m"]
    assert json.loads((folder / "smollm2-135m" / "eagle_target.json").read_text())["revision"] == results[0][1]
