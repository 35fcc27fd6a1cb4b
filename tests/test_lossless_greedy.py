"""Greedy losslessness: EAGLE's output is plain greedy decoding, token for token, whatever the head.

Targets are tiny float64 models of every supported architecture (float64 so that the tree forward and the
plain forward cannot disagree on an argmax through rounding). Each (architecture, tree, head) pair is
checked on several prompts, at short budgets, and with a stop token that fires in the middle of an
accepted path. So that these checks cannot pass vacuously, the heads are also checked to be what they
claim: the trained head accepts deep paths, the wrong head has nearly everything rejected.
"""

from __future__ import annotations

import functools

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree
from eagle.generate import GenerationResult
from eagle.tree import TreeSpec
from heads import good_head, single_thread, wrong_head
from tiny import ARCHITECTURES, tiny_target

LOGIT_SCALE = 3.0  # sharp enough that a trained head is confident, so dynamic trees grow deep paths
MAX_NEW_TOKENS = 48
PROMPTS = ((5, 17, 3, 42, 8), (1, 2, 3), (60, 9, 33, 33, 12, 7, 50, 21, 0))
TREES: dict[str, TreeSpec] = {
    "static": StaticTree(),
    "dynamic": DynamicTree(),
    "dynamic-wide": DynamicTree(depth=3, top_k=8, total_tokens=40),
}
# "vllm-layout": no fc bias and no input norm on the head's layer (HeadConfig), what training jobs build;
# "eagle3*": the EAGLE-3 kind (fused target layers, the head's own state fed back)
HEADS = ("untrained", "vllm-layout", "good", "wrong", "eagle3-untrained", "eagle3-good")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@functools.cache
def _target(arch: str):
    return tiny_target(arch, logit_scale=LOGIT_SCALE)


@functools.cache
def _head(arch: str, kind: str) -> EagleHead:
    target = _target(arch)
    if kind == "untrained":
        return EagleHead.for_target(target, seed=0)
    if kind == "vllm-layout":
        return EagleHead.for_target(target, seed=0, fc_bias=False, input_norm=False)
    if kind == "good":
        return good_head(target)
    if kind == "eagle3-untrained":
        return EagleHead.for_target(target, seed=0, kind="eagle3")
    if kind == "eagle3-good":
        return good_head(target, kind="eagle3")
    return wrong_head(target)


def _config(max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids))


@functools.cache
def _plain(arch: str, prompt: tuple[int, ...], max_new_tokens: int = MAX_NEW_TOKENS, stop: tuple[int, ...] = ()) -> GenerationResult:
    return Decoder(_target(arch), None).generate(list(prompt), _config(max_new_tokens, stop))


@functools.cache
def _eagle(arch: str, tree: str, head: str, prompt: tuple[int, ...], max_new_tokens: int = MAX_NEW_TOKENS, stop: tuple[int, ...] = ()) -> GenerationResult:
    decoder = Decoder(_target(arch), _head(arch, head), TREES[tree])
    return decoder.generate(list(prompt), _config(max_new_tokens, stop))


def _mean_tau(arch: str, tree: str, head: str) -> float:
    return sum(_eagle(arch, tree, head, p).tau for p in PROMPTS) / len(PROMPTS)


def _accepted(arch: str, tree: str, head: str) -> list[int]:
    return [step.accepted for p in PROMPTS for step in _eagle(arch, tree, head, p).steps]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_output_is_plain_greedy_output(arch: str, tree: str, head: str) -> None:
    for prompt in PROMPTS:
        expected = _plain(arch, prompt)
        result = _eagle(arch, tree, head, prompt)
        assert result.token_ids == expected.token_ids, f"prompt {prompt}"
        assert len(result.token_ids) == MAX_NEW_TOKENS and result.finish_reason == "length"
        # every step emits accepted + 1 tokens after the prefill's one (the last step may be truncated)
        assert 1 + sum(s.accepted + 1 for s in result.steps) >= MAX_NEW_TOKENS


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_short_budgets_are_a_prefix_of_plain_output(arch: str, tree: str, head: str) -> None:
    for prompt in PROMPTS[:2]:
        reference = _plain(arch, prompt).token_ids
        for max_new_tokens in (1, 2, 3):
            result = _eagle(arch, tree, head, prompt, max_new_tokens)
            assert result.token_ids == reference[:max_new_tokens], f"prompt {prompt}, budget {max_new_tokens}"
            assert result.finish_reason == "length"


def _mid_path_stop(result: GenerationResult) -> int | None:
    """Index of a token that was accepted from the draft and followed by more tokens of the same step, and
    that does not occur earlier in the output — a stop there must cut the step's accepted path."""
    emitted = 1  # the prefill's token
    for step in result.steps:
        for offset in range(step.accepted):  # positions of accepted draft tokens that are not the step's last
            index = emitted + offset
            if index < len(result.token_ids) - 1 and result.token_ids[index] not in result.token_ids[:index]:
                return index
        emitted += step.accepted + 1
    return None


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stop_token_firing_mid_path(arch: str, tree: str) -> None:
    found = 0
    for prompt in PROMPTS:
        index = _mid_path_stop(_eagle(arch, tree, "good", prompt))
        if index is None:
            continue
        found += 1
        reference = _plain(arch, prompt).token_ids
        stop = (reference[index],)
        for head in HEADS:
            result = _eagle(arch, tree, head, prompt, MAX_NEW_TOKENS, stop)
            assert result.token_ids == reference[: index + 1], f"prompt {prompt}, head {head}, stop at {index}"
            assert result.finish_reason == "stop"
        assert _plain(arch, prompt, MAX_NEW_TOKENS, stop).token_ids == reference[: index + 1]
    assert found, "the good head never accepted a path long enough to stop inside it"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stop_token_on_the_prefill_token(arch: str) -> None:
    prompt = PROMPTS[0]
    first = _plain(arch, prompt).token_ids[0]
    for tree in TREES:
        for head in HEADS:
            result = _eagle(arch, tree, head, prompt, MAX_NEW_TOKENS, (first,))
            assert result.token_ids == [first] and result.finish_reason == "stop" and result.steps == []


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_heads_are_what_the_lossless_checks_assume(arch: str, tree: str) -> None:
    """Guards against a vacuous pass: the good head accepts deep paths, the wrong head almost nothing."""
    depth = TREES[tree].depth
    good, wrong = _accepted(arch, tree, "good"), _accepted(arch, tree, "wrong")
    assert max(good) >= min(3, depth), f"good head's longest accepted path is {max(good)}"
    assert _mean_tau(arch, tree, "good") > _mean_tau(arch, tree, "untrained") + 0.5
    assert sum(a == 0 for a in wrong) >= 0.9 * len(wrong), f"wrong head accepted something in {wrong}"
    eagle3 = _accepted(arch, tree, "eagle3-good")
    assert max(eagle3) >= min(3, depth), f"trained eagle3 head's longest accepted path is {max(eagle3)}"
    assert _mean_tau(arch, tree, "eagle3-good") > _mean_tau(arch, tree, "eagle3-untrained") + 0.5


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_plain_decoding_is_hugging_face_greedy(arch: str) -> None:
    target = _target(arch)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )  # [1, len(prompt) + MAX_NEW_TOKENS]
        assert _plain(arch, prompt).token_ids == out[0, len(prompt):].tolist()
