"""Sampling losslessness (T > 0): the tokens EAGLE emits are distributed exactly as the target's.

On a 5-token target, the first four generated tokens of many seeded runs (seed = run index) are compared
with the target's exact joint distribution of its first four tokens. That distribution is computed here,
independently of the engine: transformers' own forward gives the logits of every continuation (float64),
and ``reference_probs`` applies temperature, top-k and top-p from their definitions in numpy, so a bug in
the engine's ``processed_probs`` or in its lean forward shows as a mismatch. Two statistics must both
accept: a chi-square goodness-of-fit test and a total-variation bound derived from the sample size.

The first token comes from the prefill, the next three from one or more speculative steps. The trees are
three deep with three siblings per node (``DEEP_STATIC``, ``DEEP_DYNAMIC``), so one step can accept three
drafts and a bonus token (four tokens: truncation to the budget is exercised too), and the recursive
rejection walks more than two siblings; a hybrid tree adds an n-gram branch (the prompt repeats), and two
cases run the compiled path.

Power: ``test_the_statistics_have_power_against_a_small_bias`` measures, by simulation at this sample
size, how often the test rejects a distribution at a small distance from the target's (temperature 1.1
instead of 1, TV ~0.04): at least 99 % of the time. ``test_an_injected_bias_in_verification_is_caught``
injects that bias into the engine's verification only and checks that the test rejects it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math

import numpy as np
import pytest
import torch
from scipy import stats

import eagle.batch
import eagle.verify
from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree
from eagle.compile import CompileConfig
from eagle.tree import DraftTree, HybridTree
from eagle.verify import Acceptance, SamplingConfig
from heads import good_head, single_thread
from tiny import tiny_target

logger = logging.getLogger(__name__)

VOCAB = 5
LOGIT_SCALE = 3.0  # top-token probability ~0.6 on average: neither flat nor one-hot
PROMPT = [1, 4, 2, 0, 1, 4]  # its tail (1, 4) occurred before: a hybrid tree proposes (2, 0, 1, 4)
TOKENS = 4  # the joint of the first TOKENS generated tokens is compared
RUNS = 10_000
P_MIN = 1e-3  # chi-square p-value below which the sampler is declared biased
FALSE_ALARM = 1e-6  # probability that an unbiased sampler exceeds the TV tolerance

DEEP_STATIC = StaticTree(paths=((0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0)))
DEEP_DYNAMIC = DynamicTree(depth=3, top_k=3, total_tokens=9)
SMALL_STATIC = StaticTree(paths=((0,), (1,), (0, 0), (0, 1), (1, 0)))
T1 = SamplingConfig(temperature=1.0)
TRUNCATED = SamplingConfig(temperature=0.7, top_p=0.9, top_k=3)
COMPILED = CompileConfig(mode="on", autotune=False)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@functools.cache
def _target():
    return tiny_target("llama", vocab_size=VOCAB, hidden_size=16, layers=1, logit_scale=LOGIT_SCALE)


@functools.cache
def _head(kind: str) -> EagleHead:
    """"good" (trained), "untrained", "eagle3" (trained), or "reduced": the good head's weights drafting from
    ``draft_vocab()`` only (a reduced draft vocabulary, d2t / t2d, as every trained head has)."""
    target = _target()
    if kind == "eagle3":
        return good_head(target, kind="eagle3")
    if kind == "reduced":
        return restricted(_head("good"), target, draft_vocab())
    return good_head(target) if kind == "good" else EagleHead.for_target(target, seed=0)


def restricted(head: EagleHead, target, vocab: torch.Tensor) -> EagleHead:
    """A full-vocabulary EAGLE-1 ``head``'s weights in a head whose draft vocabulary is ``vocab`` (target ids):
    it drafts the best tokens of ``vocab`` by the same scores."""
    reduced = EagleHead.for_target(target, seed=0, draft_token_ids=vocab)
    missing, unexpected = reduced.load_state_dict(head.state_dict(), strict=False)
    assert sorted(missing) == ["d2t", "t2d"] and not unexpected
    return reduced.eval()


def draft_vocab() -> torch.Tensor:
    """Every token but the one the target emits most often in its first TOKENS tokens after PROMPT (T = 1):
    a reduced head never drafts that token, so it comes out of rejections' residuals and bonus draws, and
    the draft ids map to target ids through a non-trivial d2t (the left-out token is not the last one)."""
    joint = exact_joint(1.0).reshape((VOCAB,) * TOKENS)
    frequency = sum(joint.sum(axis=tuple(a for a in range(TOKENS) if a != t)) for t in range(TOKENS))  # [V]: expected count
    left_out = int(np.argmax(frequency))
    assert left_out != VOCAB - 1, frequency
    return torch.tensor([token for token in range(VOCAB) if token != left_out])


# ---- the exact distribution, independently of the engine ----------------------------------------------


def reference_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Temperature, then top-k (keep the k largest logits), then top-p (the smallest set of most likely
    tokens whose mass reaches top_p; the most likely token always stays), renormalised. float64, ``[..., V]``."""
    z = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the strictly more likely tokens
        keep_sorted = before < top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


@functools.cache
def exact_joint(temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """``[V**TOKENS]``: P(x_1..x_TOKENS | PROMPT), from transformers' forward over every continuation."""
    target = _target()
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=TOKENS - 1)))  # [V^3, 3], lexicographic
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = target.model(input_ids=ids.to(target.device)).logits.double().cpu().numpy()  # [V^3, L + 3, V]
    n = len(PROMPT)
    joint = reference_probs(logits[0, n - 1], temperature, top_k, top_p)  # [V]: P(x_1)
    for t in range(1, TOKENS):
        rows = np.arange(0, len(prefixes), VOCAB ** (TOKENS - 1 - t))  # rows whose first t tokens are (x_1..x_t)
        conditional = reference_probs(logits[rows, n - 1 + t], temperature, top_k, top_p)  # [V^t, V]
        joint = (joint.reshape(-1, 1) * conditional).reshape(-1)
    assert abs(float(joint.sum()) - 1) < 1e-9
    return joint


def joint_for(sampling: SamplingConfig) -> np.ndarray:
    return exact_joint(sampling.temperature, sampling.top_k, sampling.top_p)


# ---- the statistics -------------------------------------------------------------------------------------


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled (smallest first) into one cell,
    which absorbs the next-smallest cell while it is itself still below 5. Zero-probability cells must be
    empty (checked by the caller) and are left out."""
    n = counts.sum()
    support = probs > 0
    counts, expected = counts[support].astype(float), probs[support] * n
    order = np.argsort(expected)
    counts, expected = counts[order], expected[order]
    small = int(np.searchsorted(expected, 5.0))  # cells [0, small) have expected < 5
    if small:
        while small < len(expected) and expected[:small].sum() < 5:
            small += 1
        counts = np.concatenate([[counts[:small].sum()], counts[small:]])
        expected = np.concatenate([[expected[:small].sum()], expected[small:]])
    return float(stats.chisquare(counts, expected * counts.sum() / expected.sum()).pvalue)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def tv_tolerance(probs: np.ndarray, n: int, false_alarm: float = FALSE_ALARM) -> float:
    """An upper bound on TV(empirical, probs) that n i.i.d. draws from ``probs`` exceed with probability
    at most ``false_alarm``.

    Mean: each empirical frequency p̂_i has standard deviation sqrt(p_i (1 - p_i) / n), so by Jensen
    E|p̂_i - p_i| <= sqrt(p_i (1 - p_i) / n) and E[TV] <= mu = 1/2 sum_i sqrt(p_i (1 - p_i) / n).
    Deviation: TV is a function of n independent draws, and changing one draw moves 1/n of mass from one
    cell to another, changing TV by at most 1/n. McDiarmid's inequality then gives
    P(TV >= E[TV] + t) <= exp(-2 n t^2), so t = sqrt(ln(1 / false_alarm) / (2 n)).
    """
    mu = 0.5 * float(np.sqrt(probs * (1 - probs) / n).sum())
    return mu + math.sqrt(math.log(1 / false_alarm) / (2 * n))


def accepts(counts: np.ndarray, probs: np.ndarray) -> bool:
    n = int(counts.sum())
    return counts[probs == 0].sum() == 0 and chi_square_p(counts, probs) > P_MIN and total_variation(counts, probs) < tv_tolerance(probs, n)


def assert_matches(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    n = int(counts.sum())
    assert counts[probs == 0].sum() == 0, f"{what}: emitted a sequence the target gives probability 0"
    p_value, tv, tolerance = chi_square_p(counts, probs), total_variation(counts, probs), tv_tolerance(probs, n)
    logger.info("%s: n = %d, chi-square p = %.3g, TV = %.4f (tolerance %.4f)", what, n, p_value, tv, tolerance)
    assert p_value > P_MIN and tv < tolerance, f"{what}: chi-square p = {p_value:.2e}, TV = {tv:.4f} (tolerance {tolerance:.4f})"


def assert_rejected(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    p_value = chi_square_p(counts, probs)
    logger.info("%s: chi-square p = %.3g, TV = %.4f", what, p_value, total_variation(counts, probs))
    assert not accepts(counts, probs), f"{what} went undetected: p = {p_value:.2e}"


# ---- sampling through the engine ------------------------------------------------------------------------


def joint_index(token_ids: list[int]) -> int:
    """The index of a TOKENS-token output in the joint distribution's ``[V**TOKENS]`` vector (base-VOCAB digits)."""
    index = 0
    for token in token_ids:
        index = index * VOCAB + token
    return index


def sample_runs(decoder: Decoder, sampling: SamplingConfig, runs: int = RUNS) -> tuple[np.ndarray, list[int]]:
    """Counts ``[V**TOKENS]`` of the first TOKENS tokens over ``runs`` generations, each drawing from its own
    seeded generator (a request with a generator drafts; one with only a seed would not), and every step's
    accepted-token count."""
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    accepted: list[int] = []
    config = GenerationConfig(max_new_tokens=TOKENS, sampling=sampling, stop_token_ids=[])
    for seed in range(runs):
        result = decoder.generate(PROMPT, config, torch.Generator().manual_seed(seed))
        assert len(result.token_ids) == TOKENS
        counts[joint_index(result.token_ids)] += 1
        accepted.extend(step.accepted for step in result.steps)
    return counts, accepted


def test_the_engines_distribution_is_the_reference_one() -> None:
    """The engine's processed distribution at the prompt equals the independent reference (no sampling
    noise here: a wrong temperature / top-k / top-p is caught exactly)."""
    target = _target()
    with torch.no_grad():
        # on the CPU, where the test compares (the target may run on a GPU: EAGLE_TEST_DEVICE, tests/tiny.py)
        logits = target.model(input_ids=torch.tensor([PROMPT], device=target.device)).logits[0, -1].double().cpu()
    for sampling in (T1, TRUNCATED, SamplingConfig(temperature=0.5, top_p=0.6), SamplingConfig(temperature=1.3, top_k=2)):
        np.testing.assert_allclose(
            eagle.verify.processed_probs(logits, sampling).numpy(),
            reference_probs(logits.numpy(), sampling.temperature, sampling.top_k, sampling.top_p), atol=1e-6,
        )


def test_plain_sampling_matches_the_exact_joint() -> None:
    """The statistic on the baseline itself (no draft): plain sampling is the reference distribution."""
    counts, _ = sample_runs(Decoder(_target(), None), T1, RUNS // 5)
    assert_matches(counts, joint_for(T1), "plain sampling")


# 10,000 sampled runs each (~1-2 minutes on 2 cores): make test keeps a trained head on the dynamic tree at T=1 and on
# the static tree with temperature, top-p and top-k; tests/test_batch.py's batched T>0 tests cover the default trees and
# a reduced draft vocabulary in make test. The rest, and the compiled cases, are nightly.
CONFIGS = [
    pytest.param("untrained", DEEP_STATIC, T1, "off", id="untrained-deep-static", marks=pytest.mark.nightly),
    pytest.param("good", DEEP_DYNAMIC, T1, "off", id="good-deep-dynamic"),
    pytest.param("good", DEEP_STATIC, TRUNCATED, "off", id="good-deep-static-T0.7-top_p0.9-top_k3"),
    pytest.param("good", HybridTree(DEEP_DYNAMIC, branch_tokens=4), T1, "off", id="good-hybrid", marks=pytest.mark.nightly),
    pytest.param("eagle3", DEEP_DYNAMIC, T1, "off", id="eagle3-deep-dynamic", marks=pytest.mark.nightly),
    pytest.param("good", DEEP_DYNAMIC, TRUNCATED, "on", id="good-deep-dynamic-truncated-compiled", marks=pytest.mark.nightly),
    pytest.param("good", HybridTree(SMALL_STATIC, branch_tokens=4), T1, "on", id="good-hybrid-compiled", marks=pytest.mark.nightly),
]


@pytest.mark.parametrize("head, tree, sampling, compile", CONFIGS)
def test_eagle_sampling_matches_the_exact_joint(head: str, tree, sampling: SamplingConfig, compile: str) -> None:
    decoder = Decoder(_target(), _head(head), tree, compile=COMPILED if compile == "on" else "off", speculate="always")
    decoder.warmup()
    counts, accepted = sample_runs(decoder, sampling)
    assert_matches(counts, joint_for(sampling), f"{head} head, {tree}, {sampling}, compile {compile}")
    # deep acceptance is exercised (3 drafts and a bonus in one step), and at T = 1 also steps that reject
    # every sibling (truncated distributions are sharp enough that a good head almost never misses them all)
    assert any(a >= 3 for a in accepted) and (sampling != T1 or any(a == 0 for a in accepted)), np.bincount(accepted)
    logger.info("%s head: mean accepted %.2f over %d steps", head, np.mean(accepted), len(accepted))
    if head == "good":
        assert np.mean(accepted) > 0.5, f"good head accepts {np.mean(accepted):.2f} tokens per step"


def test_verification_processes_only_the_rows_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """At T > 0 the processed distribution is computed for the visited nodes only (root + accepted path)."""
    rows_per_step: list[tuple[int, int]] = []
    original = eagle.verify.sample_verify

    def counting(tree: DraftTree, probs, generator) -> Acceptance:
        acceptance = original(tree, probs, generator)
        rows_per_step.append((probs.computed, len(acceptance.path)))
        return acceptance

    monkeypatch.setattr(eagle.batch, "sample_verify", counting)
    decoder = Decoder(_target(), _head("good"), DEEP_DYNAMIC)
    for seed in range(50):
        decoder.generate(PROMPT, GenerationConfig(max_new_tokens=12, sampling=T1, stop_token_ids=[]), torch.Generator().manual_seed(seed))
    assert rows_per_step and all(computed == accepted + 1 for computed, accepted in rows_per_step)
    assert max(a for _, a in rows_per_step) >= 2  # deep paths happened, and still only their rows were computed


# ---- power: the same statistics reject small biases at the same sample size -----------------------------


def test_the_statistics_have_power_against_a_small_bias() -> None:
    """By simulation: RUNS draws from the target at temperature 1.1 (every token; TV to the truth ~0.04)
    are rejected at least 99 % of the time, and draws from the truth itself accepted."""
    truth, biased = joint_for(T1), exact_joint(1.1)
    distance = 0.5 * float(np.abs(truth - biased).sum())
    rng = np.random.default_rng(0)
    trials = 100
    power = sum(not accepts(rng.multinomial(RUNS, biased), truth) for _ in range(trials)) / trials
    false_alarms = sum(not accepts(rng.multinomial(RUNS, truth), truth) for _ in range(trials)) / trials
    logger.info("TV(T=1, T=1.1) = %.4f: power %.2f, false alarms %.2f over %d simulated tests", distance, power, false_alarms, trials)
    assert 0.02 < distance < 0.08
    assert power >= 0.99 and false_alarms <= 0.02


@pytest.mark.nightly  # 10,000 sampled runs, ~1-2 minutes on 2 cores
def test_an_injected_bias_in_verification_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification that reads the target at temperature x1.1 (the prefill's token stays right) is rejected."""
    honest = eagle.verify.processed_probs

    def warmer(logits, sampling):
        return honest(logits, SamplingConfig(temperature=sampling.temperature * 1.1, top_p=sampling.top_p, top_k=sampling.top_k))

    monkeypatch.setattr(eagle.verify, "processed_probs", warmer)  # ProcessedRows: verification rows only
    counts, _ = sample_runs(Decoder(_target(), _head("good"), DEEP_DYNAMIC), T1)
    assert_rejected(counts, joint_for(T1), "verification at temperature 1.1")


def _verify_without_residual(tree: DraftTree, probs, generator) -> Acceptance:
    """A classic bug: accept child x with probability p(x), but after rejections draw the bonus from p itself
    instead of the residual norm(max(p - q, 0)), so drafted tokens are over-represented."""
    children = tree.children
    tokens = tree.tokens.tolist()
    node, path = 0, []
    while True:
        accepted = None
        for child in children[node]:
            if torch.rand((), generator=generator) < probs[node, tokens[child]]:
                accepted = child
                break
        if accepted is None:
            return Acceptance(path, int(torch.multinomial(probs[node], 1, generator=generator)))
        path.append(accepted)
        node = accepted


@pytest.mark.nightly  # 10,000 sampled runs, ~1-2 minutes on 2 cores
def test_statistics_reject_a_verifier_that_skips_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run through the engine; a quarter of the sample size already suffices."""
    monkeypatch.setattr(eagle.batch, "sample_verify", _verify_without_residual)
    counts, _ = sample_runs(Decoder(_target(), _head("good"), SMALL_STATIC), T1, RUNS // 4)
    assert_rejected(counts, joint_for(T1), "a verifier without the residual")
