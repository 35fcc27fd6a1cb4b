"""The compiled fast path (``compile="on"``): lossless, equal to the eager path, no recompiles in a request.

Greedy output equals plain decoding token for token on tiny llama / qwen2 / qwen3 / mistral targets (float64)
and on SmolLM2 (float32), through the compiled functions: dynamic trees on every architecture with a
trained head, and on llama static, auto and hybrid trees and untrained and wrong heads as well. Every call
after warm-up runs under ``fail_on_recompile``, so these generations also show that a request (new cache
capacity, growing KV length) never recompiles. The T>0 distribution through the compiled path is tested in
tests/test_lossless_sampling.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree
from eagle.compile import CompileConfig, CompiledFunction
from eagle.errors import EagleError
from eagle.runtime import head_runtime, step_inputs, target_runtime
from eagle.tree import AutoTree, HybridTree
from heads import good_head, single_thread, wrong_head
from tiny import ARCHITECTURES, tiny_target


LOGIT_SCALE = 3.0
PROMPTS = ((5, 17, 3, 42, 8), (60, 9, 33, 33, 12, 7, 50, 21, 0) * 2)  # the second repeats: hybrid branches fire
# Tiny models compile fast without GEMM autotuning (which has nothing to tune at width 32); SmolLM2 below uses it.
TINY = CompileConfig(mode="on", autotune=False)


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
    return {
        "untrained": lambda: EagleHead.for_target(target, seed=0), "good": lambda: good_head(target), "wrong": lambda: wrong_head(target),
        "eagle3": lambda: good_head(target, kind="eagle3"),
    }[kind]()


def _config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=40, stop_token_ids=[])


# Every case is `nightly`: each compiles its own graphs (the llama case ran 118 s on 2 cores, at the in-process
# tier's budget). make test's compiled lossless check is tests/test_batch.py's compiled batch of one (17 s).
CASES = [(arch, "dynamic", "good") for arch in ARCHITECTURES] + [
    ("llama", "dynamic", "untrained"), ("llama", "dynamic", "wrong"),
    ("llama", "static", "good"), ("llama", "auto", "good"), ("llama", "hybrid", "good"), ("qwen3", "hybrid", "wrong"),
    ("llama", "dynamic", "eagle3"),  # the EAGLE-3 kind: advance compiled over the fused (3 x hidden) target layers
]
CASES = [pytest.param(*case, marks=pytest.mark.nightly) for case in CASES]
TREES = {"dynamic": DynamicTree(), "static": StaticTree(), "auto": AutoTree(max_depth=4, top_ks=(2, 4), sizes=(7, 15)), "hybrid": HybridTree(DynamicTree(depth=4, top_k=3, total_tokens=12))}


@pytest.mark.parametrize("arch,tree,head", CASES)
def test_compiled_greedy_equals_plain_decoding(arch, tree, head, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path))  # the auto tree's cost cache
    target = _target(arch)
    plain = Decoder(target, None, compile=TINY)
    eagle = Decoder(target, _head(arch, head), TREES[tree], compile=TINY, speculate="always")  # every step drafts
    compiled = {**plain.warmup(), **eagle.warmup()}
    assert compiled and all(seconds > 0 for seconds in compiled.values())
    reference = Decoder(target, None)  # eager
    taus = []
    for prompt in PROMPTS:
        want = reference.generate(list(prompt), _config()).token_ids
        assert plain.generate(list(prompt), _config()).token_ids == want
        result = eagle.generate(list(prompt), _config())
        assert result.token_ids == want, f"{arch}/{tree}/{head} diverged on {prompt}"
        taus.append(result.tau)
    if head in ("good", "eagle3"):
        assert max(taus) > 1.5, f"a trained head accepts little: {taus}"
    if head == "wrong" and tree != "hybrid":
        assert max(taus) < 1.2


@pytest.mark.nightly
def test_compiled_and_eager_steps_agree_within_tolerance():
    """float32: the compiled step (fused kernels, frozen weights) against the same step run eagerly."""
    target = tiny_target("qwen2", dtype=torch.float32, logit_scale=LOGIT_SCALE)
    prompt = torch.tensor(PROMPTS[1])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    outputs = []
    for runtime in (target_runtime(target, TINY), target_runtime(target, CompileConfig(mode="off"))):
        cache = runtime.new_cache(64)
        runtime.prefill(prompt, cache)
        inputs = step_inputs(8, prompt.numel(), target.device)
        outputs.append(runtime.step(8)(ids, *inputs[1:], cache.keys, cache.values))
    (features, logits, greedy), (want_features, want_logits, want_greedy) = outputs
    torch.testing.assert_close(features, want_features, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(greedy, want_greedy)


@pytest.mark.nightly
def test_every_target_and_head_compiles_its_own_weights():
    """Frozen weights are constants of a graph: a second target or head of the same shapes must get its own
    graphs, never reuse the first one's (a reused graph would still be lossless, so greedy tests miss it)."""
    targets = [tiny_target("llama", dtype=torch.float32, logit_scale=LOGIT_SCALE, seed=seed) for seed in (0, 5)]
    ids, prompt = torch.tensor([[7, 8, 9, 10]]), torch.tensor([1, 2, 3, 4, 5])
    inputs = step_inputs(4, prompt.numel(), torch.device("cpu"))
    for target in targets:
        outputs = []
        for runtime in (target_runtime(target, TINY), target_runtime(target, CompileConfig(mode="off"))):
            cache = runtime.new_cache(64)
            runtime.prefill(prompt, cache)
            outputs.append(runtime.step(4)(ids, *inputs[1:], cache.keys, cache.values)[1])
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
    features = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
    for seed in (0, 1):
        head = EagleHead.for_target(targets[0], seed=seed)
        outputs = []
        for runtime in (head_runtime(head, targets[0], TINY), head_runtime(head, targets[0], CompileConfig(mode="off"))):
            cache = runtime.new_cache(64)
            outputs.append(runtime.expand(4)(features, ids, *inputs[1:], cache.keys, cache.values, 4)[0])
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


def test_a_compile_failure_is_loud_and_names_the_fallback():
    def broken(x):
        return torch.ops.aten.this_op_does_not_exist(x)

    with pytest.raises(EagleError, match=r"torch.compile failed for broken: .*--compile off"):
        CompiledFunction(broken, "broken", TINY, torch.device("cpu"), {})(torch.ones(3))


def test_a_recompile_during_a_request_raises():
    """After warm-up, a call that would need a new graph (here: another dtype) fails instead of compiling."""
    fn = CompiledFunction(lambda x: x * 2, "double", TINY, torch.device("cpu"), {})
    fn(torch.ones(4))
    with pytest.raises(EagleError, match="would recompile"):
        fn(torch.ones(4, dtype=torch.float64))


@pytest.mark.nightly
def test_smollm2_compiled_greedy_equals_plain(smollm2):
    """The real target in float32, an untrained head (nearly every draft rejected: the bonus-token path) and
    the hybrid tree, whose steps use both verification widths (with and without an n-gram branch)."""
    config = CompileConfig(mode="on", autotune=False)  # autotuned SmolLM2 graphs take minutes each on 2 cores
    plain = Decoder(smollm2, None, compile=config)
    eagle = Decoder(smollm2, EagleHead.for_target(smollm2, seed=0), HybridTree(), compile=config, speculate="always")
    plain.warmup(), eagle.warmup()
    taus = []
    for text in ("Write a haiku about the sea.", "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat"):
        ids = smollm2.encode(text, chat=True)
        want = Decoder(smollm2, None).generate(ids, GenerationConfig(max_new_tokens=32)).token_ids
        assert plain.generate(ids, GenerationConfig(max_new_tokens=32)).token_ids == want
        result = eagle.generate(ids, GenerationConfig(max_new_tokens=32))
        assert result.token_ids == want
        taus.append(result.tau)
    assert max(taus) > 1.2, f"the n-gram branch never accepted on a repeating prompt: {taus}"
