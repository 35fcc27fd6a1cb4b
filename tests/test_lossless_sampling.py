"""Sampling losslessness (T > 0): the tokens EAGLE emits are distributed exactly as the target's.

On a 6-token target, the first three generated tokens of many seeded runs (seed = run index) are compared
with the target's exact joint distribution of its first three tokens, obtained by enumerating all 6^3
continuations with the processed probabilities the engine itself samples from (``processed_probs``). Two
statistics must both accept: a chi-square goodness-of-fit test and a total-variation bound derived from the
sample size. Both are shown to reject a biased sampler at the same sample size, so a pass means something.

The first token comes from the prefill; the next two from one or two speculative steps (a depth-2 tree can
emit three tokens in a step, so truncation to the budget is exercised too). Trees are small and the target
is one layer of width 16 so that 10,000 runs take well under a minute.
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

import eagle.generate
from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree
from eagle.tree import DraftTree
from eagle.verify import Acceptance, SamplingConfig, processed_probs
from heads import good_head, single_thread
from tiny import tiny_target

logger = logging.getLogger(__name__)

VOCAB = 6
LOGIT_SCALE = 3.0  # top-token probability ~0.55 on average: neither flat nor one-hot
PROMPT = [1, 4, 2, 5]
TOKENS = 3  # the joint of the first TOKENS generated tokens is compared
RUNS = 10_000
P_MIN = 1e-3  # chi-square p-value below which the sampler is declared biased
FALSE_ALARM = 1e-6  # probability that an unbiased sampler exceeds the TV tolerance

SMALL_STATIC = StaticTree(paths=((0,), (1,), (0, 0), (0, 1), (1, 0)))  # siblings at both depths
SMALL_DYNAMIC = DynamicTree(depth=2, top_k=2, total_tokens=4)
T1 = SamplingConfig(temperature=1.0)
TRUNCATED = SamplingConfig(temperature=0.7, top_p=0.9, top_k=4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@functools.cache
def _target():
    return tiny_target("llama", vocab_size=VOCAB, hidden_size=16, layers=1, logit_scale=LOGIT_SCALE)


@functools.cache
def _head(kind: str) -> EagleHead:
    target = _target()
    return good_head(target) if kind == "good" else EagleHead.for_target(target, seed=0)


# ---- the exact distribution ---------------------------------------------------------------------------


@functools.cache
def exact_joint(sampling: SamplingConfig) -> np.ndarray:
    """``[V**TOKENS]`` float64: P(x_1, x_2, x_3 | PROMPT) under the target's processed distribution."""
    target = _target()
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=TOKENS - 1)))  # [V^2, 2], lexicographic
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)  # [V^2, L + 2]
    with torch.no_grad():
        logits = target.logits(target.backbone(input_ids=ids).last_hidden_state)  # [V^2, L + 2, V]
    n = len(PROMPT)
    joint = processed_probs(logits[0, n - 1], sampling).double()  # [V]: P(x_1)
    for t in range(1, TOKENS):
        # rows whose first t continuation tokens are (x_1..x_t): every V^(TOKENS-1-t)-th row
        rows = torch.arange(0, len(prefixes), VOCAB ** (TOKENS - 1 - t))
        conditional = processed_probs(logits[rows, n - 1 + t], sampling).double()  # [V^t, V]
        joint = (joint.reshape(-1, 1) * conditional).reshape(-1)
    assert abs(float(joint.sum()) - 1) < 1e-6
    return joint.numpy()


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
    For 216 cells at n = 10,000 this is roughly 0.05 + 0.026.
    """
    mu = 0.5 * float(np.sqrt(probs * (1 - probs) / n).sum())
    return mu + math.sqrt(math.log(1 / false_alarm) / (2 * n))


def assert_matches(counts: np.ndarray, probs: np.ndarray, what: str) -> tuple[float, float]:
    n = int(counts.sum())
    assert counts[probs == 0].sum() == 0, f"{what}: emitted a sequence the target gives probability 0"
    p_value, tv, tolerance = chi_square_p(counts, probs), total_variation(counts, probs), tv_tolerance(probs, n)
    logger.info("%s: n = %d, chi-square p = %.3g, TV = %.4f (tolerance %.4f)", what, n, p_value, tv, tolerance)
    assert p_value > P_MIN and tv < tolerance, f"{what}: chi-square p = {p_value:.2e}, TV = {tv:.4f} (tolerance {tolerance:.4f})"
    return p_value, tv


def assert_rejected(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    n = int(counts.sum())
    p_value, tv, tolerance = chi_square_p(counts, probs), total_variation(counts, probs), tv_tolerance(probs, n)
    logger.info("%s: n = %d, chi-square p = %.3g, TV = %.4f (tolerance %.4f)", what, n, p_value, tv, tolerance)
    assert p_value < P_MIN and tv > tolerance, f"{what} went undetected: p = {p_value:.2e}, TV = {tv:.4f} (tolerance {tolerance:.4f})"


# ---- sampling through the engine ------------------------------------------------------------------------


def sample_runs(decoder: Decoder, sampling: SamplingConfig, runs: int = RUNS) -> tuple[np.ndarray, list[int]]:
    """Counts ``[V**TOKENS]`` of the first TOKENS tokens over ``runs`` seeded generations, and every step's
    accepted-token count."""
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    accepted: list[int] = []
    for seed in range(runs):
        config = GenerationConfig(max_new_tokens=TOKENS, sampling=sampling, stop_token_ids=[], seed=seed)
        result = decoder.generate(PROMPT, config)
        assert len(result.token_ids) == TOKENS
        index = 0
        for token in result.token_ids:
            index = index * VOCAB + token
        counts[index] += 1
        accepted.extend(step.accepted for step in result.steps)
    return counts, accepted


def test_exact_joint_is_the_chain_of_plain_decoding_distributions() -> None:
    """The enumeration's cell (a, b, c) is the product of the step-by-step processed distributions."""
    target = _target()
    joint = exact_joint(T1)
    a, b, c = 2, 0, 5
    expected = 1.0
    for prefix, token in ((PROMPT, a), (PROMPT + [a], b), (PROMPT + [a, b], c)):
        features = target.forward(torch.tensor([prefix]), target.new_cache())
        expected *= float(processed_probs(target.logits(features[0, -1]), T1)[token])
    assert joint[(a * VOCAB + b) * VOCAB + c] == pytest.approx(expected, rel=1e-5)


def test_plain_sampling_matches_the_exact_joint() -> None:
    """The statistic on the baseline itself (no draft): plain sampling is the reference distribution."""
    counts, _ = sample_runs(Decoder(_target(), None), T1, RUNS // 5)
    assert_matches(counts, exact_joint(T1), "plain sampling")


CONFIGS = [
    pytest.param("untrained", SMALL_STATIC, T1, id="untrained-static"),
    pytest.param("good", SMALL_DYNAMIC, T1, id="good-dynamic"),
    pytest.param("good", SMALL_STATIC, TRUNCATED, id="good-static-T0.7-top_p0.9-top_k4"),
    pytest.param("untrained", SMALL_DYNAMIC, T1, id="untrained-dynamic", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("head, tree, sampling", CONFIGS)
def test_eagle_sampling_matches_the_exact_joint(head: str, tree: StaticTree | DynamicTree, sampling: SamplingConfig) -> None:
    counts, accepted = sample_runs(Decoder(_target(), _head(head), tree), sampling)
    assert_matches(counts, exact_joint(sampling), f"{head} head, {tree}, {sampling}")
    # both verification branches are exercised: some steps accept draft tokens, some reject every sibling
    assert any(a == 0 for a in accepted) and any(a == tree.depth for a in accepted)
    logger.info("%s head: mean accepted %.2f over %d steps", head, np.mean(accepted), len(accepted))
    if head == "good":
        assert np.mean(accepted) > 0.5, f"good head accepts {np.mean(accepted):.2f} tokens per step"


# ---- power: the same statistics reject biased samplers at the same sample size ------------------------


def test_statistics_reject_a_perturbed_target() -> None:
    """RUNS draws from the target at temperature 1.3 instead of 1 (exact TV 0.12) are rejected."""
    truth = exact_joint(T1)
    biased = exact_joint(SamplingConfig(temperature=1.3))
    counts = np.random.default_rng(0).multinomial(RUNS, biased)
    assert_rejected(counts, truth, "sampling at temperature 1.3")
    # and the draws pass against their own distribution, so the rejection is the bias, not the statistic
    assert_matches(counts, biased, "sampling at temperature 1.3 against itself")


def _verify_without_residual(tree: DraftTree, probs: torch.Tensor, generator) -> Acceptance:
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


def test_statistics_reject_a_verifier_that_skips_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run through the engine; a quarter of the sample size already suffices (TV ~ 0.26 at 10,000 runs)."""
    monkeypatch.setattr(eagle.generate, "sample_verify", _verify_without_residual)
    counts, _ = sample_runs(Decoder(_target(), _head("good"), SMALL_STATIC), T1, RUNS // 4)
    assert_rejected(counts, exact_joint(T1), "a verifier without the residual")
