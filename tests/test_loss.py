"""The EAGLE loss, the head's rollout (training-time test) and the batching of feature records."""

from __future__ import annotations

import pytest
import torch

from eagle.head import EagleHead
from eagle.loss import LossConfig, eagle_loss, rollout, rollout_metrics, soft_cross_entropy, target_token_ids
from eagle.train import build_optimizer, collate, compute_loss, token_budget_batches, train_step, warmup_linear
from eagle.tree import causal_mask
from tests.heads import continuations, single_thread
from tests.tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=64, hidden_size=32, seed=3, logit_scale=3.0)


def _features(target, tokens):
    with torch.no_grad():
        return target.backbone(input_ids=tokens).last_hidden_state


def test_rollout_equals_sequential_drafting_with_a_kv_cache(target):
    """Depth k of origin j in the parallel rollout = what decoding computes: prefill the head's cache with true
    inputs 0..j, then feed its own predictions one position at a time."""
    head = EagleHead.for_target(target, seed=1)
    tokens = continuations(target, sequences=2, length=12, temperature=1.0, seed=5)
    features = _features(target, tokens)
    depth = 4
    parallel = rollout(head, features, tokens, depth)
    assert len(parallel) == depth and parallel[0].shape == (2, 11, 32)
    for origin in (0, 3, 6):
        cache = head.new_cache()
        q = origin + 1
        predicted = head(features[:, :q], tokens[:, 1 : q + 1], cache, torch.arange(q)[None].expand(2, -1), causal_mask(q, 0, features.dtype, features.device))
        chain = [predicted[:, -1:]]
        for k in range(1, depth):
            position = torch.full((2, 1), origin + k)
            step = head(chain[-1], tokens[:, origin + k + 1 : origin + k + 2], cache, position, None)
            chain.append(step)
        for k in range(depth):
            torch.testing.assert_close(parallel[k][:, origin], chain[k][:, 0], rtol=1e-9, atol=1e-9)


def test_depth_one_loss_is_the_papers_formula(target):
    head = EagleHead.for_target(target, seed=2)
    tokens = continuations(target, sequences=3, length=10, temperature=1.0, seed=7)
    features = _features(target, tokens)
    mask = torch.ones_like(tokens)
    loss, metrics = eagle_loss(head, features, tokens, mask, LossConfig(noise=0.0))
    n = tokens.shape[1]
    predicted = head(features[:, :-1], tokens[:, 1:], None, torch.arange(n - 1)[None], causal_mask(n - 1, 0, features.dtype, features.device))
    predicted, wanted = predicted[:, : n - 2], features[:, 1 : n - 1]  # the last row has no next token to draft
    p = torch.softmax(target.lm_head(wanted).float(), -1)
    log_q = torch.log_softmax(target.lm_head(predicted).float(), -1)
    expected = torch.nn.functional.smooth_l1_loss(predicted, wanted) + 0.1 * (-(p * log_q).sum(-1)).mean()
    torch.testing.assert_close(loss.double(), expected.double(), rtol=1e-5, atol=1e-6)
    truth = tokens[:, 2:]
    assert metrics["acc_1"] == pytest.approx(float((log_q.argmax(-1) == truth).float().mean()))


def test_loss_mask_selects_positions(target):
    head = EagleHead.for_target(target, seed=2)
    tokens = continuations(target, sequences=2, length=10, temperature=1.0, seed=9)
    features = _features(target, tokens)
    mask = torch.zeros_like(tokens)
    mask[:, 6:] = 1  # "assistant" tokens from position 6: origins 4..7 draft them
    loss, _ = eagle_loss(head, features, tokens, mask, LossConfig(noise=0.0))
    tail = features.clone()
    tail[:, 9:] += 5.0  # f_9 is only the target of origin 8, whose draft x_10 does not exist: no loss there
    loss_tail, _ = eagle_loss(head, tail, tokens, mask, LossConfig(noise=0.0))
    torch.testing.assert_close(loss, loss_tail)
    corrupted = features.clone()
    corrupted[:, 1:4] += 5.0  # inputs that the counted rows read through attention: the loss must move
    assert not torch.allclose(loss, eagle_loss(head, corrupted, tokens, mask, LossConfig(noise=0.0))[0])


def test_training_steps_reduce_loss_and_raise_accuracy(target):
    """61 plain-PyTorch steps on the target's own continuations halve the loss and raise the accuracy; the
    first step reports the total norm of its own gradients (recomputed here with the same input noise)."""
    head = EagleHead.for_target(target, seed=0)
    tokens = continuations(target, sequences=16, length=24, temperature=0.0, seed=11)
    features = _features(target, tokens)
    records = [{"input_ids": t, "loss_mask": torch.ones_like(t), "features": f} for t, f in zip(tokens, features)]
    batch = collate(records)
    optimizer = build_optimizer(head, lr=1e-2)
    config = LossConfig(depth=2)
    params = [p for p in head.parameters() if p.requires_grad]
    with single_thread():
        with torch.random.fork_rng():  # the first step's gradients, with the input noise train_step draws again below
            head.train()
            loss, _ = compute_loss(head, batch, config)
            expected_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
        first = train_step(head, optimizer, batch, config)
        for _ in range(60):
            last = train_step(head, optimizer, batch, config)
    assert first["grad_norm"] == pytest.approx(float(expected_norm), rel=1e-6)
    assert last["loss"] < 0.5 * first["loss"]
    assert last["acc_1"] > first["acc_1"] + 0.2
    assert "acc_2" in last
    head.eval()
    metrics = rollout_metrics(head, batch.features, batch.input_ids, batch.loss_mask, depth=3)
    assert 1.0 <= metrics["sim_tau"] <= 4.0
    assert metrics["sim_tau"] > 1.0 + 0.5 * metrics["acc_1"]


def test_simulated_tau_of_a_one_step_chain_is_one_plus_accuracy(target):
    head = EagleHead.for_target(target, seed=4)
    tokens = continuations(target, sequences=4, length=16, temperature=1.0, seed=13)
    features = _features(target, tokens)
    metrics = rollout_metrics(head, features, tokens, torch.ones_like(tokens), depth=1)
    assert metrics["sim_tau"] == pytest.approx(1.0 + metrics["acc_1"])
    deeper = rollout_metrics(head, features, tokens, torch.ones_like(tokens), depth=3)
    assert deeper["acc_1"] == pytest.approx(metrics["acc_1"])
    assert deeper["sim_tau"] >= metrics["sim_tau"]


def test_reduced_vocabulary_maps_targets_and_drops_unknown_tokens(target):
    ids = torch.tensor([1, 5, 7, 30, 63])
    head = EagleHead.for_target(target, seed=0, draft_token_ids=ids)
    mapped = target_token_ids(head, torch.tensor([[5, 6, 63, 1]]))
    assert mapped.tolist() == [[1, -1, 4, 0]]
    assert (head.draft_to_target(mapped[mapped >= 0]) == torch.tensor([5, 63, 1])).all()


def test_token_budget_batches_cover_every_record_once_within_budget():
    lengths = [5, 300, 17, 64, 64, 1000, 3, 128] * 20
    batches = token_budget_batches(lengths, 1024, seed=0, epoch=0)
    seen = sorted(i for batch in batches for i in batch)
    assert seen == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 1024
    assert batches == token_budget_batches(lengths, 1024, seed=0, epoch=0)
    assert batches != token_budget_batches(lengths, 1024, seed=0, epoch=1)


def test_warmup_then_decay():
    values = [warmup_linear(s, warmup=10, total=100) for s in range(120)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[99] == pytest.approx(0.1 + 0.9 * (1 / 90), rel=1e-6) or values[100] == pytest.approx(0.1)
    assert min(values[10:]) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_greedy_truth_scores_against_the_targets_own_choice(target):
    """On the target's own greedy continuation, data tokens and the target's argmax coincide, so both
    criteria agree; on sampled text they differ."""
    head = EagleHead.for_target(target, seed=4)
    greedy_text = continuations(target, sequences=3, length=16, temperature=0.0, seed=21)
    features = _features(target, greedy_text)
    argmax = target.lm_head(features).argmax(-1)  # [B, n]: the target's pick after each position
    mask = torch.ones_like(greedy_text)
    assert torch.equal(argmax[:, 3:-1], greedy_text[:, 4:])  # (after the random 4-token prompt)
    by_data = rollout_metrics(head, features, greedy_text, mask, depth=3)
    by_target = rollout_metrics(head, features, greedy_text, mask, depth=3, greedy=argmax)
    assert by_target["positions"] == by_data["positions"]
    # both criteria only differ at origins whose next token comes from the random prompt
    assert abs(by_target["acc_1"] - by_data["acc_1"]) <= 3 / 13 + 1e-9
    sampled = continuations(target, sequences=3, length=16, temperature=1.0, seed=22)
    feats = _features(target, sampled)
    choice = target.lm_head(feats).argmax(-1)
    metrics = rollout_metrics(head, feats, sampled, mask, depth=1, greedy=choice)
    predicted = rollout(head, feats, sampled, 1)[0][:, :-1]  # origins 0..n-3 draft x_2..x_{n-1}
    expected = (head.draft_logits(predicted).argmax(-1) == choice[:, 1:-1]).double().mean()
    assert metrics["acc_1"] == pytest.approx(float(expected))


# ---- EAGLE-3 heads -----------------------------------------------------------------------------------------


def _fused(target, head, tokens):
    from tests.heads import target_features

    return target_features(target, tokens, head)


def test_eagle3_rollout_feeds_the_heads_own_state_like_sequential_drafting(target):
    """Depth 1 reads the fused target layers through fc, deeper depths the head's own output: the parallel
    rollout equals prefill-then-feed-back decoding, as for EAGLE-1."""
    head = EagleHead.for_target(target, seed=1, kind="eagle3")
    tokens = continuations(target, sequences=2, length=12, temperature=1.0, seed=5)
    features, fused = _fused(target, head, tokens)
    assert fused.shape == (2, 12, 3 * 32)
    depth = 4
    parallel = rollout(head, fused, tokens, depth)
    for origin in (0, 5):
        cache = head.new_cache()
        q = origin + 1
        chain = [head(fused[:, :q], tokens[:, 1 : q + 1], cache, torch.arange(q)[None].expand(2, -1), causal_mask(q, 0, fused.dtype, fused.device))[:, -1:]]
        for k in range(1, depth):
            chain.append(head(chain[-1], tokens[:, origin + k + 1 : origin + k + 2], cache, torch.full((2, 1), origin + k), None))
        for k in range(depth):
            torch.testing.assert_close(parallel[k][:, origin], chain[k][:, 0], rtol=1e-9, atol=1e-9)


def test_eagle3_loss_is_soft_cross_entropy_per_depth_with_out_of_vocabulary_tokens_masked(target):
    """EAGLE-3's loss: no feature term; depth k's cross-entropy against the target's draft-vocabulary
    distribution, weighted 0.8^(k-1); a position whose next token is outside the draft vocabulary counts for
    nothing (the reference masks them out)."""
    ids = torch.arange(0, 64, 2)  # even tokens only
    head = EagleHead.for_target(target, seed=2, kind="eagle3", draft_token_ids=ids)
    tokens = continuations(target, sequences=3, length=10, temperature=1.0, seed=7)
    features, fused = _fused(target, head, tokens)
    mask = torch.ones_like(tokens)
    config = LossConfig.for_kind("eagle3", depth=2)
    assert (config.w_feature, config.w_token, config.noise, config.depth_decay) == (0.0, 1.0, 0.0, 0.8)
    loss, metrics = eagle_loss(head, features, tokens, mask, config, inputs=fused)
    with torch.no_grad():
        predictions = rollout(head, fused, tokens, 2)
    n = tokens.shape[1]
    expected, weights = 0.0, 0.0
    for k, predicted in enumerate(predictions):
        rows = n - 2 - k  # origins whose drafted token x_{j+k+2} exists
        truth = tokens[:, k + 2 :]
        keep = (truth % 2 == 0).double()
        p = torch.softmax(target.lm_head(features[:, k + 1 : k + 1 + rows])[..., ids].double(), -1)
        log_q = torch.log_softmax(head.draft_logits(predicted[:, :rows]).double(), -1)
        ce = -(p * log_q).sum(-1)
        expected += 0.8**k * float((ce * keep).sum() / keep.sum())
        weights += 0.8**k
    assert float(loss) == pytest.approx(expected / weights, rel=1e-5)
    assert metrics["feature_loss"] == 0.0
    assert bool((tokens[:, 2:] % 2 == 1).any())  # the mask had positions to drop


def test_eagle3_training_raises_accuracy_and_keeps_the_lm_head_frozen(target):
    head = EagleHead.for_target(target, seed=0, kind="eagle3")
    lm_head = head.lm_head.weight.detach().clone()
    torch.testing.assert_close(lm_head, target.lm_head.weight.detach())  # initialised from the target's rows
    tokens = continuations(target, sequences=16, length=24, temperature=0.0, seed=11)
    features, fused = _fused(target, head, tokens)
    records = [{"input_ids": t, "loss_mask": torch.ones_like(t), "features": f, "aux_features": a} for t, f, a in zip(tokens, features, fused)]
    batch = collate(records)
    assert batch.aux_features.shape == fused.shape
    optimizer = build_optimizer(head, lr=1e-2)
    config = LossConfig.for_kind("eagle3", depth=3)
    with single_thread():
        first = train_step(head, optimizer, batch, config)
        for _ in range(60):
            last = train_step(head, optimizer, batch, config)
    assert last["loss"] < 0.75 * first["loss"]  # a soft cross-entropy: it cannot fall below the target's entropy
    assert last["acc_1"] > first["acc_1"] + 0.2 and last["acc_3"] > first["acc_3"]
    assert torch.equal(head.lm_head.weight, lm_head)
    head.eval()
    metrics = rollout_metrics(head, batch.features, batch.input_ids, batch.loss_mask, depth=3, inputs=batch.aux_features)
    assert metrics["sim_tau"] > 1.0 + 0.5 * metrics["acc_1"]


def test_an_eagle1_head_ignores_the_fused_layers_a_dataset_also_holds(target):
    """One feature dump serves both kinds: records with aux_features train an eagle1 head on the final
    features exactly as records without them."""
    from eagle.train import compute_loss

    head = EagleHead.for_target(target, seed=0)
    eagle3 = EagleHead.for_target(target, seed=0, kind="eagle3")
    tokens = continuations(target, sequences=4, length=12, temperature=1.0, seed=2)
    features, fused = _fused(target, eagle3, tokens)
    plain = collate([{"input_ids": t, "loss_mask": torch.ones_like(t), "features": f} for t, f in zip(tokens, features)])
    both = collate([{"input_ids": t, "loss_mask": torch.ones_like(t), "features": f, "aux_features": a} for t, f, a in zip(tokens, features, fused)])
    config = LossConfig(noise=0.0)
    torch.testing.assert_close(compute_loss(head, both, config)[0], compute_loss(head, plain, config)[0])
    with pytest.raises(ValueError, match="fused target layers"):
        compute_loss(eagle3, plain, LossConfig.for_kind("eagle3", depth=2))


def _dense_loss(head, features, tokens, loss_mask, config, inputs=None):
    """The loss computed over every position and masked afterwards (what eagle_loss did before it computed
    the logits only where the loss counts): the reference for the gathered version."""
    from eagle.loss import _shift, _valid

    eagle3 = head.config.kind == "eagle3"
    predictions = rollout(head, inputs if eagle3 else features, tokens, config.depth, noise=0.0)
    target_p = torch.softmax(head.target_logits(features), -1).detach()
    total, weights = 0.0, 0.0
    for k, predicted in enumerate(predictions):
        truth = target_token_ids(head, _shift(tokens, k + 2))
        valid = _valid(loss_mask, k) & ((truth >= 0) if eagle3 else True)
        count = valid.sum().clamp(min=1)
        feature = 0.0
        if not eagle3:
            feature = (torch.nn.functional.smooth_l1_loss(predicted, _shift(features, k + 1), reduction="none").mean(-1) * valid).sum() / count
        ce = -(_shift(target_p, k + 1) * torch.log_softmax(head.draft_logits(predicted), -1)).sum(-1)
        total = total + config.depth_decay**k * (config.w_feature * feature + config.w_token * (ce * valid).sum() / count)
        weights += config.depth_decay**k
    return total / weights


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_the_loss_and_its_gradients_equal_the_dense_masked_computation(target, kind):
    """Prompt tokens, padding and out-of-vocabulary positions are skipped before the LM-head logits; the
    value and every gradient stay those of computing everything and masking afterwards."""
    head = EagleHead.for_target(target, seed=4, kind=kind, draft_token_ids=torch.arange(0, 64, 2))
    tokens = continuations(target, sequences=3, length=14, temperature=1.0, seed=13)
    features, fused = _fused(target, head, tokens) if kind == "eagle3" else (_features(target, tokens), None)
    mask = torch.zeros_like(tokens)
    mask[0, 4:] = 1  # an answer after a 4-token prompt
    mask[1, 7:11] = 1  # an answer followed by padding
    mask[2, 2:] = 1
    config = LossConfig.for_kind(kind, depth=3, noise=0.0)
    loss, _ = eagle_loss(head, features, tokens, mask, config, inputs=fused)
    grads = torch.autograd.grad(loss, [p for p in head.parameters() if p.requires_grad])
    expected = _dense_loss(head, features, tokens, mask, config, inputs=fused)
    expected_grads = torch.autograd.grad(expected, [p for p in head.parameters() if p.requires_grad])
    torch.testing.assert_close(loss, expected.float(), rtol=1e-6, atol=1e-7)
    assert any(bool(g.abs().sum() > 0) for g in grads)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("train_weight", [False, True])
def test_chunked_soft_cross_entropy_equals_the_dense_formula(chunk, train_weight):
    """Value, argmax and gradients of the chunked loss (gradient computed in its forward) equal autograd's
    through the full logits, whatever the chunking, for rows that repeat and a weight that trains or not."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=generator, requires_grad=True)
    weight = torch.randn(20, 8, generator=generator).requires_grad_(train_weight)
    p = torch.softmax(torch.randn(6, 20, generator=generator) * 3, -1)
    rows = torch.tensor([0, 1, 2, 2, 5, 4, 3, 0, 1, 5])
    total, argmax = soft_cross_entropy(x, weight, p, rows, chunk=chunk)
    (2.5 * total).backward()
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(train_weight)
    logits = x_ref @ w_ref.t()
    reference = -(p[rows] * torch.log_softmax(logits, -1)).sum()
    (2.5 * reference).backward()
    torch.testing.assert_close(total, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(argmax, logits.argmax(-1))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    if train_weight:
        torch.testing.assert_close(weight.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    else:
        assert weight.grad is None
    with torch.no_grad():
        value, drafted = soft_cross_entropy(x, weight, p, rows, chunk=chunk)
    assert not value.requires_grad and value == total.detach() and torch.equal(drafted, argmax)


def test_cross_entropy_on_a_share_of_positions_is_its_mean_there(target):
    """ce_fraction < 1: the soft cross-entropy is averaged over a random share of the counted positions (drawn
    from torch's generator after the rollout's noise), the feature regression over all of them; averaged over
    draws the token loss is the full one's."""
    head = EagleHead.for_target(target, seed=2)
    tokens = continuations(target, sequences=3, length=24, temperature=1.0, seed=7)
    features = _features(target, tokens)
    mask = torch.ones_like(tokens)
    n = tokens.shape[1]
    _, full = eagle_loss(head, features, tokens, mask, LossConfig(noise=0.0))
    with torch.no_grad():
        predicted = head(features[:, :-1], tokens[:, 1:], None, torch.arange(n - 1)[None], causal_mask(n - 1, 0, features.dtype, features.device))
        predicted, wanted = predicted[:, : n - 2], features[:, 1 : n - 1]
        p = torch.softmax(target.lm_head(wanted).float(), -1)
        per_row = -(p * torch.log_softmax(target.lm_head(predicted).float(), -1)).sum(-1)  # [B, n-2]
    draws = []
    for seed in range(40):
        torch.manual_seed(seed)
        kept = torch.rand(tokens.shape) < 0.5  # the draw eagle_loss makes: position t keeps p(. | f_t)
        torch.manual_seed(seed)
        loss, metrics = eagle_loss(head, features, tokens, mask, LossConfig(noise=0.0, ce_fraction=0.5))
        expected = per_row[kept[:, 1 : n - 1]].mean()  # origin j is scored against p(. | f_{j+1})
        assert metrics["token_loss"] == pytest.approx(float(expected), rel=1e-5)
        assert metrics["feature_loss"] == pytest.approx(full["feature_loss"], rel=1e-6)
        draws.append(metrics["token_loss"])
    assert sum(draws) / len(draws) == pytest.approx(full["token_loss"], rel=0.03)
    assert min(draws) != max(draws)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="ce_fraction"):
            LossConfig(ce_fraction=bad)
