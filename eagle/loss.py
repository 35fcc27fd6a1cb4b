"""EAGLE's training objective, and the head's own multi-step rollout used for per-depth metrics.

Objective (EAGLE, arXiv 2401.15077, section 4.1): the head reads feature f_j and token x_{j+1} and predicts
f_{j+1}. Its loss is SmoothL1(f̂_{j+1}, f_{j+1}) + w_token · CE(p_{j+2}, q_{j+2}), where p is the target's
next-token distribution at f_{j+1} (the LM head applied to the true feature) and q the same LM head applied to
the prediction. Inputs are perturbed with U(-noise, noise) (section 4.1, "data augmentation") so the head is
robust to its own errors when it later reads its predictions. With a reduced draft vocabulary (EAGLE-3, arXiv
2503.01840) both p and q live on the draft rows of the LM head; p is renormalised over them.

Rollout (EAGLE-3's "training-time test", arXiv 2503.01840 section 3.2): at draft depth k > 1 the head reads its
own depth-(k-1) prediction, not the target's feature. ``rollout`` reproduces what decoding does, for every
origin position j at once: the depth-k query of origin j attends to the true-feature keys of positions <= j and
to the keys of its own chain (depths 2..k), one diagonal per depth. That gives the top-1 accuracy of each
depth under the chain's own inputs and a simulated acceptance length, the numbers that tell during training
whether decoding will accept anything (``rollout_metrics``); ``eagle_loss(depth > 1)`` trains on it.

EAGLE-3 heads (``HeadConfig.kind == "eagle3"``, arXiv 2503.01840 section 3): the head reads the fused
low / middle / high features (``inputs`` ``[B, n, 3h]``) at depth 1 and its own output at deeper depths; its
output is not a target feature, so the loss is the soft cross-entropy alone (no feature regression), every
depth of the rollout weighted ``depth_decay^(k-1)``, and positions whose next data token lies outside a
reduced draft vocabulary are masked out (the reference masks on the target's argmax; the data token is the
target's own greedy choice for regenerated data and costs no full-vocabulary logits). ``LossConfig.for_kind``
gives each kind its defaults.

Shapes: B batch, n tokens (right-padded), h hidden, V draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from eagle.head import EagleHead

NEG_INF = float("-inf")


@dataclass(frozen=True)
class LossConfig:
    w_feature: float = 1.0
    w_token: float = 0.1
    noise: float = 0.1  # U(-noise, noise) added to input features
    depth: int = 1  # >1: also train on the head's rolled-out predictions (training-time test)
    depth_decay: float = 0.8  # weight of depth k is decay^(k-1)

    @classmethod
    def for_kind(cls, kind: str, **overrides) -> "LossConfig":
        """Defaults per head kind: EAGLE-1's (above), or EAGLE-3's (cross-entropy only, a 7-step
        training-time test, no input noise: the test's own errors take its place). ``overrides`` that are
        None keep the default."""
        base = {"w_feature": 0.0, "w_token": 1.0, "noise": 0.0, "depth": 7} if kind == "eagle3" else {}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


def target_token_ids(head: EagleHead, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids; tokens outside a reduced draft vocabulary become -1 (never predicted)."""
    if not head.reduced_vocab:
        return tokens
    t2d = head.t2d.to(tokens.device)
    draft_index = torch.cumsum(t2d.long(), 0) - 1  # target id -> its rank among draft ids
    mapped = draft_index[tokens]
    return torch.where(t2d[tokens], mapped, torch.full_like(mapped, -1))


def _causal(q: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.full((q, q), NEG_INF, dtype=dtype, device=device).triu(1)
    return mask[None, None]


def _chain_mask(length: int, depth: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, 1, L, depth*L]``: depth-``depth`` queries over [block 0 (causal) | blocks 2..depth (diagonal)]."""
    base = torch.full((length, length), NEG_INF, dtype=dtype, device=device)
    blocks = [base.triu(1)]
    diagonal = torch.full((length, length), NEG_INF, dtype=dtype, device=device).fill_diagonal_(0.0)
    blocks += [diagonal] * (depth - 1)
    return torch.cat(blocks, dim=1)[None, None]


def rollout(head: EagleHead, features: torch.Tensor, tokens: torch.Tensor, depth: int, *, noise: float = 0.0) -> list[torch.Tensor]:
    """The head's predictions at depths 1..``depth`` for every origin position.

    ``features`` ``[B, n, input]`` are what the head reads from the target at f_0..f_{n-1} (its final
    features; the fused ones for an EAGLE-3 head) and ``tokens`` ``[B, n]`` x_0..x_{n-1}. Output k
    (0-based, depth k+1) is ``[B, n-1, h]``: row j predicts f_{j+k+1} having read f_j (true) and then its own
    predictions, with tokens x_{j+1}..x_{j+k+1} (teacher-forced along the true path, which is the only path
    whose acceptance counts). Rows whose targets run past the sequence are garbage; callers mask them.
    """
    from transformers import DynamicCache

    batch, n, _ = features.shape
    length = n - 1
    device, dtype = features.device, features.dtype
    inputs = features[:, :-1]
    if noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    cache = DynamicCache() if depth > 1 else None
    positions = torch.arange(length, device=device)[None].expand(batch, -1)
    predicted = head(inputs, tokens[:, 1:], cache, positions, _causal(length, dtype, device))
    outputs = [predicted]
    for k in range(1, depth):
        # depth k+1 of origin j reads (f̂ of depth k, token x_{j+k+1}) at position j+k
        shifted = torch.zeros_like(tokens[:, 1:])
        shifted[:, : max(length - k, 0)] = tokens[:, k + 1 :]
        predicted = head(predicted, shifted, cache, positions + k, _chain_mask(length, k + 1, dtype, device))
        outputs.append(predicted)
    return outputs


def _valid(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, n-1]`` bool: origin j at depth k+1 counts when the drafted token x_{j+k+2} exists and is an
    assistant (loss-masked) token."""
    batch, n = loss_mask.shape
    valid = torch.zeros(batch, n - 1, dtype=torch.bool, device=loss_mask.device)
    span = n - 2 - k
    if span > 0:
        valid[:, :span] = loss_mask[:, k + 2 :].bool()
    return valid


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """Rows j -> x[:, j+k] for j < n-k (the rest zero-filled): ``[B, n-1, ...]`` from ``[B, n, ...]``."""
    out = torch.zeros_like(x[:, 1:])
    span = x.shape[1] - k
    if span > 0:
        out[:, :span] = x[:, k:][:, :span]
    return out


def _reads(head: EagleHead, features: torch.Tensor, inputs: torch.Tensor | None) -> torch.Tensor:
    """What the head reads from the target: the fused layers for an EAGLE-3 head, the final features for an
    EAGLE-1 head (which ignores fused layers a dataset may also hold)."""
    if head.config.kind != "eagle3":
        return features
    if inputs is None:
        raise ValueError("an eagle3 head reads the fused target layers: pass inputs (features made with aux_layers)")
    return inputs


def eagle_loss(
    head: EagleHead,
    features: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    *,
    inputs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The EAGLE loss over a right-padded batch; returns (loss, metrics). ``features`` ``[B, n, h]`` are the
    target's final features (the distribution to distil, and EAGLE-1's regression target); ``inputs`` what
    the head reads (EAGLE-3: the fused ``[B, n, 3h]``; default ``features``).

    metrics: ``loss``, ``feature_loss``, ``token_loss`` (depth 1), ``acc_1`` (depth-1 top-1 accuracy of the
    draft against the true next token) and, when ``config.depth > 1``, the same per depth.
    """
    eagle3 = head.config.kind == "eagle3"
    predictions = rollout(head, _reads(head, features, inputs), tokens, config.depth, noise=config.noise)
    with torch.no_grad():  # the target's distribution at every position, once: depth k reads it k + 1 positions on
        target_p = torch.softmax(head.target_logits(features), dim=-1)  # [B, n, V] on the draft rows
    total = features.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    weight_sum = 0.0
    for k, predicted in enumerate(predictions):
        truth = target_token_ids(head, _shift(tokens, k + 2))  # x_{j+k+2}, as a draft id (-1: outside)
        valid = _valid(loss_mask, k)
        if eagle3:
            valid = valid & (truth >= 0)
        count = valid.sum().clamp(min=1)
        if eagle3:  # the head's output is its own state, not a target feature: nothing to regress
            feature_loss = predicted.new_zeros((), dtype=torch.float32)
        else:
            wanted = _shift(features, k + 1)  # f_{j+k+1}
            feature_loss = (F.smooth_l1_loss(predicted.float(), wanted.float(), reduction="none").mean(-1) * valid).sum() / count
        p = _shift(target_p, k + 1)  # p(. | f_{j+k+1})
        log_q = torch.log_softmax(head.draft_logits(predicted), dim=-1)
        token_loss = (-(p * log_q).sum(-1) * valid).sum() / count
        weight = config.depth_decay**k
        total = total + weight * (config.w_feature * feature_loss + config.w_token * token_loss)
        weight_sum += weight
        with torch.no_grad():
            correct = (log_q.argmax(-1) == truth) & valid
            metrics[f"acc_{k + 1}"] = float(correct.sum() / count)
        if k == 0:
            metrics["feature_loss"] = float(feature_loss.detach())
            metrics["token_loss"] = float(token_loss.detach())
    loss = total / weight_sum
    metrics["loss"] = float(loss.detach())
    return loss, metrics


@torch.no_grad()
def rollout_metrics(
    head: EagleHead,
    features: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    depth: int,
    *,
    greedy: torch.Tensor | None = None,
    inputs: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-depth top-1 accuracy along the data path (``acc_k`` = P(depth k right | depths < k right)) and the
    simulated acceptance length of a depth-``depth`` chain, ``sim_tau`` = 1 + E[run of right drafts], the
    tau a chain-shaped tree would get at T=0 (a tree with more branches gets more).

    "Right" means equal to the data's next token, or, with ``greedy`` ``[B, n]`` (the target's own argmax
    after each position: ``greedy[:, t]`` = argmax of its logits at f_t), equal to what the target would
    pick there, which is what greedy verification accepts. Use ``greedy`` when the data is not the target's
    own greedy output (e.g. ShareGPT's answers). ``inputs``: what the head reads, as in ``eagle_loss``."""
    predictions = rollout(head, _reads(head, features, inputs), tokens, depth)
    base = _valid(loss_mask, 0)
    alive = base.clone()
    run = torch.zeros_like(base, dtype=torch.long)
    metrics: dict[str, float] = {}
    for k, predicted in enumerate(predictions):
        wanted = _shift(tokens, k + 2) if greedy is None else _shift(greedy, k + 1)  # x_{j+k+2} or argmax p(.|f_{j+k+1})
        truth = target_token_ids(head, wanted)
        right = (head.draft_logits(predicted).argmax(-1) == truth) & _valid(loss_mask, k)
        asked = alive.sum()
        metrics[f"acc_{k + 1}"] = float((right & alive).sum() / asked) if asked > 0 else 0.0
        alive = alive & right
        run += alive.long()
    positions = base.sum().clamp(min=1)
    metrics["sim_tau"] = 1.0 + float(run[base].sum() / positions)
    metrics["positions"] = float(base.sum())
    return metrics

