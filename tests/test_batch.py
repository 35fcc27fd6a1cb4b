"""Continuous batching (``eagle.batch``): lossless per request inside a batch.

* Greedy, fp32: in mixed batches (different prompts and lengths, requests arriving while others run,
  different budgets and stop tokens so some finish mid-batch, a trained and an untrained head, dynamic,
  static and hybrid trees, the policy forced to draft, forced plain and measured) every request's output
  equals its batch-1 plain decoding token for token.
* Batched drafting drafts, row for row, the tree that single-request drafting drafts.
* T > 0: the first four tokens of a request decoded inside batches of other requests follow the target's
  exact joint distribution (the statistics of tests/test_lossless_sampling.py), also with each default
  tree and a reduced draft vocabulary while greedy rows draft in the same verification forwards (those
  still equal plain decoding).
* Seeds: a seeded request's output does not depend on the batch it runs in, and a request resumed from
  any prefix of its output continues exactly as the uninterrupted run (greedy and seeded sampling).
* The policy's decisions follow its measured costs.
"""

from __future__ import annotations

import functools
import random
from collections import Counter

import numpy as np
import pytest
import torch

from eagle import Decoder, DynamicTree, EagleHead, GenerationConfig, StaticTree
import eagle.step_costs
from eagle.admission import step_seed
from eagle.batch import BatchDecoder
from eagle.policy import SpeculationPolicy
from eagle.errors import EagleError
from eagle.tree import HybridTree, build_tree
from eagle.verify import SamplingConfig
from heads import good_head, wrong_head
from tiny import tiny_target
from test_lossless_sampling import (  # noqa: F401 - _one_thread: that module's autouse one-thread fixture, used here too
    PROMPT, TOKENS, RUNS, VOCAB, T1, DEEP_DYNAMIC, _head, _one_thread, _target, assert_matches, joint_for, joint_index, restricted,
)


@functools.cache
def _greedy_target():
    return tiny_target("llama", vocab_size=64, hidden_size=32, layers=2, dtype=torch.float32, seed=3, logit_scale=2.0)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(rng.randrange(1, 24))] for _ in range(count)]


def _plain(target, prompt, config):
    return Decoder(target, None).generate(prompt, config).token_ids


def _run_mixed(engine: BatchDecoder, jobs: list[tuple[int, list[int], GenerationConfig]]):
    """Submit each job at its arrival step; step until all are done; return the requests in job order."""
    requests: dict[int, object] = {}
    step = 0
    while len(requests) < len(jobs) or not engine.idle:
        for index, (arrival, prompt, config) in enumerate(jobs):
            if arrival == step and index not in requests:
                requests[index] = engine.submit(prompt, config)
        engine.step()
        step += 1
        assert step < 10_000
    return [requests[i] for i in range(len(jobs))]


TREES = {
    "dynamic": DynamicTree(depth=4, top_k=3, total_tokens=10),
    "static": StaticTree(paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    "hybrid": HybridTree(DynamicTree(depth=3, top_k=2, total_tokens=6), branch_tokens=4),
}


def _recorded(policy: SpeculationPolicy) -> tuple[list[tuple[int, float, float, str]], list[float]]:
    """Record ``policy``'s calls from now on: every ``choose`` as (batch, tau and break-even at that moment,
    decision), and every value it ``observe``s."""
    choices: list[tuple[int, float, float, str]] = []
    observed: list[float] = []
    choose, observe = policy.choose, policy.observe

    def recording_choose(batch: int) -> str:
        tau, even = policy.tau, policy.break_even(batch)
        decision = choose(batch)
        choices.append((batch, tau, even, decision))
        return decision

    def recording_observe(tokens_per_row: float) -> None:
        observed.append(tokens_per_row)
        observe(tokens_per_row)

    policy.choose, policy.observe = recording_choose, recording_observe
    return choices, observed


@pytest.mark.parametrize("head_kind", ["good", "untrained"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("speculate", ["always", "never", "auto"])
def test_greedy_in_a_mixed_batch_equals_batch_one_plain_decoding(head_kind, tree, speculate):
    """Every request equals its batch-1 plain decoding. The steps drafted exactly when the policy said so:
    every row of a step records the step's batch and decision, the policy's own counts agree, and each
    drafting step fed its acceptance back. Under "auto" (measured costs, a prior at the break-even so the
    first step drafts) each decision follows the policy's rule at that moment: draft iff its tau reached
    the break-even at that batch size."""
    target = _greedy_target()
    head = good_head(target) if head_kind == "good" else EagleHead.for_target(target, seed=1)
    decoder = Decoder(target, head, TREES[tree])
    engine = BatchDecoder(decoder, max_batch=4, max_context=256, speculate=speculate)
    if speculate == "auto":  # measured costs (on a loaded CPU they vary from run to run); explore often
        engine.warmup(repeats=1)
        engine.policy.explore_every = 3
        # the prior: drafting just pays at every batch size, so the first step drafts; what the steps accept decides the rest
        engine.policy.tau = max(engine.policy.break_even(batch) for batch in range(1, 5))
    choices, observed = _recorded(engine.policy)
    prompts = _prompts(9, seed=len(tree))
    jobs = []
    for i, prompt in enumerate(prompts):
        stop = [prompt[0]] if i % 3 == 0 else []  # some stop on a token, most run to their budget
        config = GenerationConfig(max_new_tokens=5 + 7 * (i % 4), stop_token_ids=stop)
        jobs.append((i // 2 * 3, prompt, config))  # arrivals while others run; at most 4 live at once
    requests = _run_mixed(engine, jobs)
    batches = set()
    for (arrival, prompt, config), request in zip(jobs, requests):
        assert request.error is None and request.done
        assert request.token_ids == _plain(target, prompt, config), (prompt, config)
        batches.update(step.batch for step in request.steps)
    assert max(batches) >= 3, batches  # the requests really shared steps
    steps = [step for r in requests for step in r.steps]
    assert all((step.tree_size > 0) == (step.policy != "plain") for step in steps)  # drafted iff the policy said so
    # a step of b rows is recorded by each of its b rows, with its batch size and the policy's decision
    assert len(choices) == engine.steps
    per_step = Counter((batch, decision) for batch, _, _, decision in choices)
    assert Counter((step.batch, step.policy) for step in steps) == {key: n * key[0] for key, n in per_step.items()}
    decisions = Counter(decision for *_, decision in choices)
    assert engine.policy.report()["decisions"] == {kind: decisions[kind] for kind in ("draft", "plain", "explore")}
    drafting = decisions["draft"] + decisions["explore"]
    assert len(observed) == drafting and all(value >= 1 for value in observed)  # accepted + 1 tokens per row
    if speculate == "auto":
        assert choices[0][3] == "draft", choices[0]  # the prior's first step
        assert all((decision == "draft") == (tau >= even) for _, tau, even, decision in choices), choices
    else:
        assert set(decisions) == {"always": {"draft"}, "never": {"plain"}}[speculate], decisions
    if head_kind == "good" and speculate != "never":
        assert sum(s.accepted for s in steps) > 0  # drafts were accepted inside the batch


@pytest.mark.parametrize("tree", list(TREES))
def test_eagle3_head_in_a_mixed_batch_equals_batch_one_plain_decoding(tree):
    """The EAGLE-3 kind through the batched paths (the fused target layers in the verification and plain
    steps, the catch-up, batched drafting): every request still decodes as alone."""
    target = _greedy_target()
    engine = BatchDecoder(Decoder(target, good_head(target, kind="eagle3"), TREES[tree]), max_batch=4, max_context=256, speculate="always")
    jobs = [(i // 2 * 3, prompt, GenerationConfig(max_new_tokens=5 + 7 * (i % 4), stop_token_ids=[])) for i, prompt in enumerate(_prompts(8, seed=40))]
    requests = _run_mixed(engine, jobs)
    for (arrival, prompt, config), request in zip(jobs, requests):
        assert request.error is None and request.done
        assert request.token_ids == _plain(target, prompt, config), (prompt, config)
    assert max(step.batch for r in requests for step in r.steps) >= 3
    assert sum(s.accepted for r in requests for s in r.steps) > 0


def test_target_alone_batches_plain_decoding():
    target = _greedy_target()
    engine = BatchDecoder(Decoder(target, None), max_batch=3, max_context=128)
    jobs = [(i, prompt, GenerationConfig(max_new_tokens=6 + i, stop_token_ids=[])) for i, prompt in enumerate(_prompts(5, 7))]
    for (arrival, prompt, config), request in zip(jobs, _run_mixed(engine, jobs)):
        assert request.token_ids == _plain(target, prompt, config)
        assert all(step.tree_size == 0 and step.policy == "plain" for step in request.steps)


def test_the_head_consumes_a_prompt_only_when_its_row_first_drafts():
    """Admitting a request runs the target alone: the prompt's (feature, next token) pairs wait with those of
    the plain steps since, and the catch-up before the row's first draft leaves the head where a head
    prefilled over the whole committed context would be, whether the row catches up on its own (more pairs
    than the compiled catch-up takes) or in the batched forward beside rows that do."""
    target = _greedy_target()
    decoder = Decoder(target, good_head(target), TREES["dynamic"])
    engine = BatchDecoder(decoder, max_batch=3, max_context=128, speculate="never")
    width = decoder._widths()["advance"][0]
    long_prompts = [p for p in _prompts(12, 5) if len(p) > width]
    config = GenerationConfig(max_new_tokens=40, stop_token_ids=[])

    def assert_caught_up():
        for index, row in enumerate(engine.rows):
            assert row.pending == 0 and row.head_committed == row.committed
            committed = row.context[: row.committed]
            _, features = decoder.runtime.prefill(torch.tensor(committed), decoder.runtime.new_cache(128))
            cache = decoder.head_runtime.new_cache(128)
            alone = decoder.head_runtime.prefill(features, torch.tensor(committed[1:] + [row.root]), cache)
            torch.testing.assert_close(row.last_hidden, alone[-1], atol=1e-5, rtol=1e-5)
            view, n = engine.head_cache.row(index), row.committed
            for got, want in zip(view.keys + view.values, cache.keys + cache.values):
                torch.testing.assert_close(got[:, :, :n], want[:, :, :n], atol=1e-5, rtol=1e-5)

    for prompt in long_prompts[:2]:
        engine.submit(prompt, config)
    engine.step()
    engine.step()
    assert all(row.head_committed == 0 and row.last_hidden is None and row.pending == row.committed for row in engine.rows)
    with torch.inference_mode():
        engine._catch_up()  # both rows on their own: their prompts are longer than the width
    assert_caught_up()
    engine.step()  # one plain step: a pair each, within the width
    engine.submit(long_prompts[2], config)
    engine.step()  # admits the third row, whose prompt is still pending
    assert [row.pending <= width for row in engine.rows] == [True, True, False]
    with torch.inference_mode():
        engine._catch_up()  # the new row alone, then the other two in one batched forward
    assert_caught_up()


@pytest.mark.parametrize("vocab", ["full", "reduced"])
@pytest.mark.parametrize("spec", [DynamicTree(depth=4, top_k=3, total_tokens=10), StaticTree(paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))])
def test_batched_drafting_drafts_each_rows_single_request_tree(spec, vocab):
    """Rows drafted together draft the trees each request drafts alone (batch 1 runs the single-row
    functions, compiled where the decoder compiles). Also for a head with a reduced draft vocabulary (the even tokens: d2t maps draft ids to target ids):
    with test_sampled_and_greedy_rows_verified_together_stay_lossless, which samples through batched
    drafting, this carries the T > 0 check of such heads over to single-request drafting."""
    target = _greedy_target()
    head = good_head(target) if vocab == "full" else restricted(good_head(target), target, torch.arange(0, 64, 2))
    decoder = Decoder(target, head, spec)
    engine = BatchDecoder(decoder, max_batch=3, max_context=128)
    for prompt in _prompts(3, 11):
        engine.submit(prompt, GenerationConfig(max_new_tokens=50, stop_token_ids=[]))
    engine.step()  # admit all three and take one step, so rows sit at different lengths
    batched = engine.draft()
    singles = []
    for row in engine.rows:  # each request alone: a batch of one resumed at the same tokens
        alone = BatchDecoder(decoder, max_batch=1, max_context=128)
        alone.submit(row.request.prompt_ids, row.request.config, generated=row.request.token_ids)
        alone.admit()
        singles += alone.draft()
    for tree, single in zip(batched, singles):
        assert tree.tokens.tolist() == single.tokens.tolist()
        assert tree.parents.tolist() == single.parents.tolist()
        torch.testing.assert_close(tree.scores, single.scores, atol=1e-5, rtol=1e-5)  # fp32 GEMMs of another shape
        assert vocab == "full" or all(token % 2 == 0 for token in tree.tokens[1:].tolist())  # drafted in its vocabulary


def test_a_request_sampled_inside_batches_follows_the_targets_distribution():
    """RUNS requests of PROMPT at T=1 (unseeded: seeded ones do not draft), decoded 12 at a time beside 4
    requests of other prompts that arrive one step later; counts of their first TOKENS tokens against the
    exact joint."""
    torch.manual_seed(0)  # the unseeded requests' streams come from torch's global generator
    target, head = _target(), _head("good")
    engine = BatchDecoder(Decoder(target, head, DEEP_DYNAMIC), max_batch=16, max_context=64, speculate="always")
    rng = random.Random(5)
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    accepted = []
    for start in range(0, RUNS, 12):
        ours = [engine.submit(PROMPT, GenerationConfig(max_new_tokens=TOKENS, sampling=T1, stop_token_ids=[]))
                for _ in range(start, min(start + 12, RUNS))]
        engine.step()
        for _ in range(4):
            other = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
            engine.submit(other, GenerationConfig(max_new_tokens=rng.randrange(1, 8), sampling=T1, stop_token_ids=[]))
        engine.run_until_done()
        for request in ours:
            assert len(request.token_ids) == TOKENS
            counts[joint_index(request.token_ids)] += 1
            accepted.extend(step.accepted for step in request.steps)
    assert_matches(counts, joint_for(T1), "inside a batch")
    assert any(a >= 2 for a in accepted)


# the engine's default tree of each kind (``build_tree``: the CLI's and the Serve pairs' defaults); "auto"
# resolves by measurement to a DynamicTree within its bounds
DEFAULT_TREES = {kind: build_tree(kind) for kind in ("dynamic", "static", "hybrid")}
# a quarter of RUNS, as test_statistics_reject_a_verifier_that_skips_the_residual: by simulation it rejects a
# bias of TV ~0.1 (verification at temperature 1.2) 100 % of the time, one of TV ~0.05 (1.1) only about half
MIXED_RUNS = RUNS // 4
MIXED_OURS = 56  # requests of PROMPT per batch, beside the greedy rows


@functools.cache
def _greedy_rows() -> tuple[tuple[list[int], GenerationConfig, list[int]], ...]:
    """Eight greedy requests of other prompts on the sampling target, each with its batch-1 plain decoding."""
    rng = random.Random(9)
    rows = []
    for _ in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        config = GenerationConfig(max_new_tokens=rng.randrange(TOKENS, 8), stop_token_ids=[])  # about as long as ours
        rows.append((prompt, config, _plain(_target(), prompt, config)))
    return tuple(rows)


@pytest.mark.parametrize("kind", list(DEFAULT_TREES))
def test_sampled_and_greedy_rows_verified_together_stay_lossless(kind):
    """The serving configuration at T > 0: each default tree, a head with a reduced draft vocabulary (which
    leaves out the target's most frequent token, ``draft_vocab``), speculate="always". MIXED_RUNS requests
    of PROMPT at T=1 (unseeded) decode 56 at a time beside 8 greedy requests of other prompts, all admitted
    in one step, so their first steps share one drafting verification forward: counts of the sampled
    requests' first TOKENS tokens against the exact joint, and every greedy request equals its plain
    decoding."""
    torch.manual_seed(0)  # the unseeded requests' streams come from torch's global generator
    target, head = _target(), _head("reduced")
    engine = BatchDecoder(Decoder(target, head, DEFAULT_TREES[kind]), max_batch=64, max_context=64, speculate="always")
    greedy = _greedy_rows()
    counts = np.zeros(VOCAB**TOKENS, dtype=np.int64)
    accepted = []
    for start in range(0, MIXED_RUNS, MIXED_OURS):
        ours = [engine.submit(PROMPT, GenerationConfig(max_new_tokens=TOKENS, sampling=T1, stop_token_ids=[]))
                for _ in range(start, min(start + MIXED_OURS, MIXED_RUNS))]
        theirs = [engine.submit(prompt, config) for prompt, config, _ in greedy]
        engine.run_until_done()
        assert [r.token_ids for r in theirs] == [plain for *_, plain in greedy]
        # one verification forward held every row, each with a drafted tree
        assert {(r.steps[0].batch, r.steps[0].tree_size > 0) for r in ours + theirs} == {(len(ours) + len(theirs), True)}
        for request in ours:
            assert len(request.token_ids) == TOKENS
            counts[joint_index(request.token_ids)] += 1
            accepted.extend(step.accepted for step in request.steps)
    assert_matches(counts, joint_for(T1), f"{kind} tree, reduced draft vocabulary, beside greedy rows")
    assert any(a >= 3 for a in accepted) and any(a == 0 for a in accepted), np.bincount(accepted)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "seeded-T1"])
@pytest.mark.parametrize("with_head", [True, False], ids=["eagle", "plain"])
def test_seeded_output_is_independent_of_the_batch_and_resumes_exactly(sampling, with_head):
    target = _greedy_target()
    decoder = Decoder(target, good_head(target) if with_head else None, TREES["dynamic"])
    prompt = _prompts(1, 21)[0]
    config = GenerationConfig(max_new_tokens=30, sampling=sampling, stop_token_ids=[], seed=1234)
    alone = BatchDecoder(decoder, max_batch=1, max_context=128)
    request = alone.submit(prompt, config)
    alone.run_until_done()
    reference = request.token_ids
    crowded = BatchDecoder(decoder, max_batch=4, max_context=128)
    others = [crowded.submit(p, GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0.8), seed=i)) for i, p in enumerate(_prompts(3, 22))]
    crowded.step()
    again = crowded.submit(prompt, config)
    crowded.run_until_done()
    assert again.token_ids == reference and all(o.done for o in others)
    drafted = any(step.tree_size > 0 for step in request.steps)
    assert drafted == (with_head and sampling.greedy)  # seeded sampling never drafts (eagle.admission.seeded_sampling)
    # resume after the tokens of each step (what a client holds when a replica dies between two steps)
    cuts, total = [], 0
    for output in request.outputs:
        total += len(output.token_ids)
        cuts.append(total)
    for cut in cuts[:-1]:
        engine = BatchDecoder(decoder, max_batch=2, max_context=128)
        resumed = engine.submit(prompt, config, generated=reference[:cut])
        engine.run_until_done()
        assert resumed.token_ids == reference, f"resumed after {cut} tokens"
        assert sum(len(o.token_ids) for o in resumed.outputs) == len(reference) - cut


def test_bad_requests_fail_at_submit_with_a_clear_error():
    engine = BatchDecoder(Decoder(_greedy_target(), None), max_batch=2, max_context=32)
    with pytest.raises(EagleError, match="context of 32"):
        engine.submit(list(range(20)), GenerationConfig(max_new_tokens=20))
    with pytest.raises(EagleError, match="prompt token ids"):
        engine.submit([999], GenerationConfig(max_new_tokens=2))
    with pytest.raises(EagleError, match="exceed max_new_tokens"):
        engine.submit([1, 2], GenerationConfig(max_new_tokens=2), generated=[3, 4, 5])


def test_cancel_frees_the_row_and_others_continue():
    target = _greedy_target()
    engine = BatchDecoder(Decoder(target, good_head(target), TREES["dynamic"]), max_batch=2, max_context=128)
    prompts = _prompts(2, 31)
    config = GenerationConfig(max_new_tokens=24, stop_token_ids=[])
    first, second = (engine.submit(p, config) for p in prompts)
    engine.step()
    engine.step()
    engine.cancel(first)
    engine.run_until_done()
    assert first.finish_reason == "cancelled" and len(first.token_ids) < 24
    assert second.token_ids == _plain(target, prompts[1], config)


def test_a_wave_of_arrivals_hands_out_each_first_token_as_its_prefill_ends():
    target = _greedy_target()
    engine = BatchDecoder(Decoder(target, None), max_batch=4, max_context=64)
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=[])
    requests = [engine.submit(p, config) for p in _prompts(3, 5)]
    seen: list[list[int]] = []  # at each call: how many outputs each request has

    def on_admit() -> None:
        seen.append([len(r.outputs) for r in requests])

    events = engine.step(on_admit=on_admit)
    # the first request's first token exists before the second's prefill runs, and so on; then the step
    assert seen == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert [len(r.outputs) for r in requests] == [2, 2, 2] and len(events) == 6
    for request in requests:
        assert request.queue_s is not None and request.queue_s >= 0
        assert request.prefill_s is not None and request.prefill_s > 0
    engine.run_until_done()
    assert [r.token_ids for r in requests] == [_plain(target, r.prompt_ids, config) for r in requests]


def test_the_policy_drafts_only_where_measured_costs_say_it_pays():
    # speculative steps cost 2x a plain step at batch 1 and 6x at batch 8 (verification turns compute-bound)
    policy = SpeculationPolicy({1: 10.0, 8: 20.0}, {1: 20.0, 8: 120.0}, prior_tau=3.0, explore_every=1000)
    assert policy.break_even(1) == 2.0 and policy.break_even(8) == 6.0
    assert policy.choose(1) == "draft" and policy.choose(8) == "plain"
    assert 2.0 < policy.break_even(4) < 6.0  # interpolated
    for _ in range(60):
        policy.observe(1.2)  # the drafts stop being accepted
    assert policy.tau < 2.0 and policy.choose(1) == "plain"
    # exploring costs about one plain step in explore_every: a speculative step worth 3 plain ones comes
    # after 4 x (3 - 1) = 8 steps, one worth 6 after 4 x 5 = 20
    explorer = SpeculationPolicy({1: 10.0, 8: 20.0}, {1: 30.0, 8: 120.0}, prior_tau=1.0, explore_every=4, explore_backoff=1)
    assert [explorer.choose(1) for _ in range(16)] == (["plain"] * 7 + ["explore"]) * 2
    assert [explorer.choose(8) for _ in range(20)] == ["plain"] * 19 + ["explore"]
    # each exploration that leaves drafting behind doubles the next interval, up to explore_backoff x; a real
    # draft (the head got good) resets it
    backoff = SpeculationPolicy({1: 10.0}, {1: 30.0}, prior_tau=1.0, explore_every=4, explore_backoff=4)
    gaps = []
    for _ in range(4):
        steps = 1
        while backoff.choose(1) != "explore":
            steps += 1
        gaps.append(steps)
        backoff.observe(1.0)
    assert gaps == [8, 16, 32, 32]
    assert backoff.report()["explore_scale"] == 4
    backoff.tau = 3.5
    assert backoff.choose(1) == "draft" and backoff.report()["explore_scale"] == 1
    backoff.tau = 1.0
    assert [backoff.choose(1) for _ in range(8)] == ["plain"] * 7 + ["explore"]
    unmeasured = SpeculationPolicy({1: 10.0}, {}, prior_tau=1.0)  # nothing to draft with: never explores
    assert {unmeasured.choose(1) for _ in range(100)} == {"plain"}
    assert policy.report()["decisions"]["plain"] >= 2


def test_warmup_stops_measuring_drafting_once_it_cannot_pay(monkeypatch):
    """The start-up measurement times speculative steps only up to the first batch size whose break-even
    passes the most tokens a step can yield (depth + 1); plain steps at every size; the policy extrapolates
    the rest, so those sizes decode plainly. Costs are synthetic: the rule is under test, not the clock."""
    target = _greedy_target()
    tree = DynamicTree(depth=3, top_k=2, total_tokens=6)  # at most 4 tokens per row and step
    engine = BatchDecoder(Decoder(target, good_head(target), tree), max_batch=16, max_context=128, speculate="auto")
    ratios = {1: 2.0, 2: 3.5, 4: 4.5, 8: 7.0, 16: 11.0}  # speculative / plain, rising with the batch
    timed = []

    def fake_step(loop, batch: int, speculative: bool, repeats: int) -> float:
        timed.append((batch, speculative))
        return 10.0 * batch ** 0.5 * (ratios[batch] if speculative else 1.0)

    monkeypatch.setattr(eagle.step_costs, "time_step", fake_step)
    report = engine.warmup()
    assert sorted(b for b, s in timed if not s) == [1, 2, 4, 8, 16]
    assert sorted(b for b, s in timed if s) == [1, 2, 4]  # 4 is the first past 4 tokens a step: 8 and 16 unmeasured
    assert list(report["speculative_ms"]) == [1, 2, 4]
    engine.policy.tau = 4.0  # the most a step can yield: still below the extrapolated break-even at 8 and 16
    assert engine.policy.choose(2) == "draft" and engine.policy.break_even(8) > 4.0 and engine.policy.break_even(16) > 4.0

def test_step_seed_depends_on_seed_and_position_only():
    assert step_seed(1, 10) == step_seed(1, 10)
    assert len({step_seed(s, p) for s in range(30) for p in range(30)}) == 900


def _modules_of(kind, *modules: torch.nn.Module) -> list[str]:
    """Names of the ``kind`` modules in ``modules`` (shared submodules listed under every name)."""
    return [f"{i}.{name}" for i, module in enumerate(modules)
            for name, m in module.named_modules(remove_duplicate=False) if isinstance(m, kind)]


def test_packed_linears_compute_what_the_linears_do():
    """``packable`` tells the truth, and the batched path's target model (``TargetRuntime.rows_model`` under
    compile "on") computes what the plain lean model does, on either kind of CPU. Where oneDNN packs bf16:
    a ``PackedLinear`` equals F.linear, and every linear the lean model calls is packed. Where it does not
    (an AVX2-only CPU): packing raises, and the runtime keeps the compiled graphs' own plain-linear model."""
    from eagle.compile import CompileConfig
    from eagle.model import LeanModel
    from eagle.runtime import PackedLinear, TargetRuntime, packable

    linear = torch.nn.Linear(48, 80, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    if packable(linear.weight):
        with torch.inference_mode():
            assert torch.equal(PackedLinear(linear)(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    else:
        with pytest.raises(RuntimeError):
            PackedLinear(linear)
    target = tiny_target("qwen2", vocab_size=64, hidden_size=32, layers=2, dtype=torch.bfloat16)
    runtime = TargetRuntime(target, CompileConfig(mode="on", autotune=False))
    rows = runtime.rows_model
    if packable(target.lm_head.weight):
        assert rows is not runtime.model  # its own instance: the compiled graphs' model keeps its linears
        assert not _modules_of(torch.nn.Linear, rows) and len(_modules_of(PackedLinear, rows)) == 2 * 7 + 1
    else:
        assert rows is runtime.model
        assert not _modules_of(PackedLinear, rows) and len(_modules_of(torch.nn.Linear, rows)) == 2 * 7 + 1
    assert not _modules_of(PackedLinear, runtime.model, target.model)
    plain = LeanModel(target.backbone, target.lm_head, target.config, 256)
    ids = torch.tensor([[3, 9, 27, 5], [60, 1, 1, 44]], device=target.device)
    positions = torch.arange(4, device=target.device).expand(2, 4)
    mask = torch.ones(4, 4, dtype=torch.bool, device=target.device).tril().expand(2, 1, 4, 4)
    with torch.inference_mode():
        outputs = [model.step_rows(ids, positions, positions, mask, cache.keys, cache.values)
                   for model, cache in ((plain, plain.new_cache(64, 2)), (rows, rows.new_cache(64, 2)))]
    for want, got in zip(*outputs):  # head input, logits, greedy ids: the same oneDNN kernels on prepacked weights
        assert torch.equal(got, want)


def test_packing_a_lean_head_leaves_the_shared_head_as_it_is():
    """The batched path's runtimes under compile "on" (``HeadRuntime.rows_lean``, ``TargetRuntime.rows_model``)
    pack their own lean instances where ``packable`` says oneDNN packs bf16, and keep the compiled graphs'
    plain-linear instances where it does not (an AVX2-only CPU). Either way the EagleHead inside is shared
    with the compiled single-request graphs, which guard on its modules' types (an EAGLE-3 head's lm_head):
    those stay as they were, and the head's rows path computes what an unpacked lean head computes."""
    from eagle.compile import CompileConfig
    from eagle.head import LeanHead
    from eagle.runtime import HeadRuntime, PackedLinear, TargetRuntime, packable

    target = tiny_target("llama", vocab_size=64, hidden_size=32, layers=6, dtype=torch.bfloat16)
    head = EagleHead.for_target(target, seed=1, kind="eagle3")  # untrained: packing does not read its values
    compile = CompileConfig(mode="on", autotune=False)
    before = {name: type(m) for name, m in head.named_modules()}
    heads, runtime = HeadRuntime(head, target, compile), TargetRuntime(target, compile, head.config.head_layers)
    lean, model = heads.rows_lean, runtime.rows_model
    own = lambda m: [n for n in _modules_of(torch.nn.Linear, m) if not n.startswith("0.head.")]  # noqa: E731 - not the shared head's
    if packable(head.fc.weight):
        assert lean is not heads.lean and model is not runtime.model
        assert isinstance(lean.fc, PackedLinear) and isinstance(lean.layers[0].q_proj, PackedLinear)
        assert not own(lean) and not own(model) and len(_modules_of(PackedLinear, model)) == 6 * 7 + 1
    else:
        assert lean is heads.lean and model is runtime.model
        assert not _modules_of(PackedLinear, lean, model) and type(lean.fc) is torch.nn.Linear
        assert len(own(lean)) == 1 + 7 and len(own(model)) == 6 * 7 + 1  # fc and the layer's linears; the target's
    assert not _modules_of(PackedLinear, head, heads.lean, runtime.model)
    assert {name: type(m) for name, m in head.named_modules()} == before
    assert type(head.lm_head) is torch.nn.Linear and type(head.fc) is torch.nn.Linear
    unpacked = LeanHead(head, 256)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 5, unpacked.input_size, generator=generator).to(torch.bfloat16).to(target.device)
    tokens = torch.randint(0, 64, (2, 5), generator=generator).to(target.device)
    positions = torch.arange(5, device=target.device).expand(2, 5)
    mask = torch.ones(5, 5, dtype=torch.bool, device=target.device).tril().expand(2, 1, 5, 5)
    with torch.inference_mode():
        got, want = (m(features, tokens, positions, positions, mask, cache.keys, cache.values)
                     for m, cache in ((lean, lean.new_cache(64, 2)), (unpacked, unpacked.new_cache(64, 2))))
    assert torch.equal(got, want)


def test_compiled_batch_of_one_and_eager_batches_stay_lossless():
    """Under compile="on" a batch of one runs the compiled single-request graphs and larger batches the eager
    batched path; requests move between the two as others join and leave: outputs still equal plain decoding."""
    from eagle.compile import CompileConfig

    target = _greedy_target()
    decoder = Decoder(target, good_head(target), TREES["dynamic"], compile=CompileConfig(mode="on", autotune=False))
    engine = BatchDecoder(decoder, max_batch=3, max_context=128, speculate="always")
    engine.warmup(repeats=1)
    prompts = _prompts(4, 41)
    jobs = [(0, prompts[0], GenerationConfig(max_new_tokens=40, stop_token_ids=[])),
            *[(5 + 2 * i, p, GenerationConfig(max_new_tokens=8, stop_token_ids=[])) for i, p in enumerate(prompts[1:])]]
    requests = _run_mixed(engine, jobs)
    for (_, prompt, config), request in zip(jobs, requests):
        assert request.token_ids == _plain(target, prompt, config)
    assert {step.batch for step in requests[0].steps} >= {1, 2}


def _recorded_forwards(engine: BatchDecoder) -> list[tuple[int, int, int | None]]:
    """Record every target forward ``engine`` runs from now on: (rows, tokens per row, the batch graph it ran
    or None when it ran eagerly or on the single-request graphs)."""
    forwards: list[tuple[int, int, int | None]] = []
    graphs: list[int] = []
    rows_step, target_rows = engine.runtime.rows_step, engine.target_rows

    def recording_rows_step(batch: int):
        graph = rows_step(batch)

        def call(*args):
            graphs.append(batch)
            return graph(*args)

        return call

    def recording_target_rows(ids, *args):
        before = len(graphs)
        out = target_rows(ids, *args)
        forwards.append((*ids.shape, graphs[-1] if len(graphs) > before else None))
        return out

    engine.runtime.rows_step, engine.target_rows = recording_rows_step, recording_target_rows
    return forwards


@pytest.mark.nightly  # compiles two batch graphs per wrapper
@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python-wrapper", "cpp-wrapper"])
def test_batch_graphs_pad_plain_steps_and_stay_lossless(cpp_wrapper):
    """``graphs=(2, 4)``: plain steps of 2 rows run the 2-row graph, of 3-4 rows the 4-row graph (3 padded
    up), of 5 rows the eager step; drafting steps (an exploring step every third one) stay eager. Every
    output equals plain decoding, and the steps really ran at each of those sizes with both graphs
    compiled, drafting steps among them. Also with inductor's C++ wrapper, which the Serve pairs compile
    with (``CompileConfig.cpp_wrapper``)."""
    from eagle.compile import CompileConfig

    target = _greedy_target()
    config = CompileConfig(mode="on", autotune=False, cpp_wrapper=cpp_wrapper)
    decoder = Decoder(target, good_head(target), TREES["dynamic"], compile=config)
    engine = BatchDecoder(decoder, max_batch=5, max_context=128, speculate="auto", graphs=(4, 2))
    assert engine.graphs == (2, 4)
    engine.warmup(repeats=1)
    assert set(decoder.runtime.compile_seconds()) >= {f"{target.name} rows[2]", f"{target.name} rows[4]"}
    # the measured costs vary with the machine's load: a fixed schedule instead (drafting costs 2 plain
    # steps, tau stays 1, no backoff): plain, plain, explore, plain, plain, explore, ...
    engine.policy = SpeculationPolicy({1: 1.0}, {1: 2.0}, prior_tau=1.0, smoothing=0.0, explore_every=3, explore_backoff=1)
    forwards = _recorded_forwards(engine)
    jobs = [(i, prompt, GenerationConfig(max_new_tokens=6 + 5 * (i % 3), stop_token_ids=[])) for i, prompt in enumerate(_prompts(7, 43))]
    requests = _run_mixed(engine, jobs)
    for (_, prompt, config), request in zip(jobs, requests):
        assert request.error is None and request.token_ids == _plain(target, prompt, config), (prompt, config)
    steps = [step for r in requests for step in r.steps]
    plain_batches = {step.batch for step in steps if step.policy == "plain"}
    assert {2, 3, 4, 5} <= plain_batches, plain_batches
    assert {step.batch for step in steps if step.policy == "explore" and step.tree_size > 0} & {2, 3, 4, 5}  # batched drafting steps ran
    assert len(forwards) == engine.steps
    padded = {1: None, 2: 2, 3: 4, 4: 4, 5: None}
    assert all(graph == (padded[rows] if width == 1 else None) for rows, width, graph in forwards), forwards
    assert {graph for *_, graph in forwards} == {None, 2, 4} and any(width > 1 and rows > 1 for rows, width, _ in forwards)


def test_batch_graphs_are_checked():
    from eagle.compile import CompileConfig

    target = _greedy_target()
    with pytest.raises(EagleError, match="compile 'on'"):
        BatchDecoder(Decoder(target, None), max_batch=4, graphs=(2,))
    compiled = Decoder(target, None, compile=CompileConfig(mode="on", autotune=False))
    for bad in ((1,), (5,), (2, 8)):
        with pytest.raises(EagleError, match=r"2\.\.4"):
            BatchDecoder(compiled, max_batch=4, graphs=bad)


# ---- batch 1 is a batch of one: the same policy decides whether a single request drafts -------------------------


@pytest.mark.parametrize("kind", ["wrong", "good"])
def test_a_single_request_drafts_only_with_a_head_that_pays(kind):
    """``Decoder`` runs each request as a batch of one under the decoder's ``SpeculationPolicy``, which
    persists across its requests: with costs where drafting pays from tau 1.5 on, a head that predicts the
    target drafts in most steps (not on a prompt where it accepts nothing), and a head that never does falls
    back to plain decoding after a few steps (asserted on the policy's own counts). Either way the output is
    plain decoding's."""
    target = _greedy_target()
    head = good_head(target) if kind == "good" else wrong_head(target)
    decoder = Decoder(target, head, TREES["dynamic"])
    decoder.policy = SpeculationPolicy({1: 10.0}, {1: 15.0}, prior_tau=2.0, explore_every=16)
    config = GenerationConfig(max_new_tokens=60, stop_token_ids=[])
    for prompt in _prompts(4, 21):
        result = decoder.generate(prompt, config)
        assert result.token_ids == _plain(target, prompt, config)
        assert all(step.policy in ("draft", "explore", "plain") for step in result.steps)
        assert all((step.tree_size > 0) == (step.policy != "plain") for step in result.steps)
    decisions = decoder.policy.decisions
    drafted = decisions["draft"] + decisions["explore"]
    if kind == "good":
        assert decisions["draft"] > decisions["plain"], decisions  # it stops on prompts it predicts badly, too
        assert decoder.policy.tau > 1.5
    else:
        assert decisions["plain"] > 3 * drafted, decisions
        assert decoder.policy.tau < 1.5


def test_warmup_measures_the_single_request_costs_the_policy_decides_by():
    target = _greedy_target()
    decoder = Decoder(target, good_head(target), TREES["dynamic"])
    assert decoder.policy.break_even(1) == 1.0  # unmeasured: drafts every step
    decoder.warmup()
    report = decoder.policy.report()
    assert report["mode"] == "auto" and report["plain_ms"][1] > 0 and report["speculative_ms"][1] > 0
    assert decoder.policy.break_even(1) == pytest.approx(report["speculative_ms"][1] / report["plain_ms"][1], rel=1e-2)
    always = Decoder(target, good_head(target), TREES["dynamic"], speculate="always")
    always.warmup()
    result = always.generate(_prompts(1, 3)[0], GenerationConfig(max_new_tokens=20, stop_token_ids=[]))
    assert all(step.policy == "draft" and step.tree_size > 0 for step in result.steps)
    with pytest.raises(EagleError, match="speculate must be one of"):
        Decoder(target, None, speculate="sometimes")


def test_a_live_policy_decides_by_the_step_times_it_observes():
    """Start-up costs are synthetic forwards; a live policy (what ``measure`` builds) corrects each kind by the
    step times it sees, so host work a real speculative step pays moves its break-even."""
    policy = SpeculationPolicy({1: 10.0}, {1: 20.0}, prior_tau=2.5, live=True)
    assert policy.break_even(1) == 2.0 and policy.choose(1) == "draft"
    policy.observe_step(1, False, 15.0)  # drafting not seen yet: it takes plain decoding's correction
    assert policy.break_even(1) == pytest.approx(2.0)
    for _ in range(40):
        policy.observe_step(1, True, 60.0)  # a real speculative step costs twice the modelled plain-corrected one
    assert policy.break_even(1) == pytest.approx(4.0, rel=0.02)
    assert policy.choose(1) == "plain"
    assert policy.report()["live_ratio"] == {"plain": 1.5, "speculative": pytest.approx(3.0, rel=0.02)}
    by_hand = SpeculationPolicy({1: 10.0}, {1: 20.0})
    by_hand.observe_step(1, True, 60.0)
    assert by_hand.break_even(1) == 2.0 and by_hand.report()["live_ratio"] is None
