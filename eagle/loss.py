"""EAGLE's training objective, and the head's own multi-step rollout used for per-depth metrics.

Objective (EAGLE, arXiv 2401.15077, section 4.1): the head reads feature f_j and token x_{j+1} and predicts
f_{j+1}. Its loss is SmoothL1(f̂_{j+1}, f_{j+1}) + w_token · CE(p_{j+2}, q_{j+2}), where p is the target's
next-token distribution at f_{j+1} (the LM head applied to the true feature) and q the same LM head applied to
the prediction. Inputs are perturbed with U(-noise, noise) (section 4.1, "data augmentation") so the head is
robust to its own errors when it later reads its predictions. With a reduced draft vocabulary (EAGLE-3, arXiv
2503.01840) both p and q live on the draft rows of the LM head; p is renormalised over them. With
``LossConfig.ce_fraction`` < 1 the cross-entropy term is the mean over a random share of the positions (drawn
anew each call), which estimates the full mean at that share of the LM-head cost.

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

from eagle.chain_attention import ChainMask
from eagle.head import EagleHead


@dataclass(frozen=True)
class LossConfig:
    w_feature: float = 1.0
    w_token: float = 0.1
    noise: float = 0.1  # U(-noise, noise) added to input features
    depth: int = 1  # >1: also train on the head's rolled-out predictions (training-time test)
    depth_decay: float = 0.8  # weight of depth k is decay^(k-1)
    ce_fraction: float = 1.0  # <1: the soft cross-entropy on a random share of the counted positions (below)

    def __post_init__(self):
        if not 0.0 < self.ce_fraction <= 1.0:
            raise ValueError(f"ce_fraction must be in (0, 1], got {self.ce_fraction}")

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
    device = features.device
    inputs = features[:, :-1]
    if noise > 0:
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise
    cache = DynamicCache() if depth > 1 else None
    positions = torch.arange(length, device=device)[None].expand(batch, -1)
    predicted = head(inputs, tokens[:, 1:], cache, positions, ChainMask(length, 1))
    outputs = [predicted]
    for k in range(1, depth):
        # depth k+1 of origin j reads (f̂ of depth k, token x_{j+k+1}) at position j+k
        shifted = torch.zeros_like(tokens[:, 1:])
        shifted[:, : max(length - k, 0)] = tokens[:, k + 1 :]
        predicted = head(predicted, shifted, cache, positions + k, ChainMask(length, k + 1))
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


CE_CHUNK_ROWS = 128  # rows of logits alive at once in soft_cross_entropy (64-128 were fastest on a 2-core CPU)
CE_CHUNK_ROWS_GPU = 4096  # on an accelerator: [4096, 16k] float32 logits are 256 MiB, and fewer, larger launches


class _SoftCrossEntropy(torch.autograd.Function):
    """Chunked soft cross-entropy through a linear layer, with the gradient computed in the forward.

    For rows x_i, distributions p_i and z_i = W x_i: returns sum_i -sum_v p_iv log softmax(z_i)_v and
    argmax_v z_i. The logits of ``CE_CHUNK_ROWS`` rows exist at a time; dL/dz = softmax(z) - p is turned into
    dL/dx = (softmax(z) - p) W (and dL/dW when W trains) chunk by chunk, so the ``[rows, V]`` logits,
    log-probabilities and their gradients are never held, and the elementwise passes over them run on
    cache-sized blocks. The same idea as fused linear cross-entropy kernels (Liger-Kernel,
    arXiv 2410.10989; Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", arXiv
    2411.09009), in plain torch. Under autocast the matmuls run in its dtype, the softmax in float32.
    """

    @staticmethod
    def forward(ctx, x, weight, p, rows, chunk):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        device = x.device.type
        # the matmul dtype: autocast's when on (cast once here, not per chunk), else the weight's
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            argmax = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
            grad_x = torch.empty_like(x) if want_x else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
            for start in range(0, x.shape[0], chunk):
                xs = x[start : start + chunk].to(dtype)
                z = torch.nn.functional.linear(xs, w).float()
                argmax[start : start + chunk] = z.argmax(-1)
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                ps = p[rows[start : start + chunk]]
                mass = ps.sum(-1, keepdim=True)  # 1 for a distribution
                total += (lse * mass).sum() - (ps * z).sum()
                if want_x or want_w:
                    g = z.sub_(lse).exp_().mul_(mass).sub_(ps)  # dL/dz = softmax(z) * mass - p, in place of z
                    if want_x:
                        grad_x[start : start + chunk] = torch.matmul(g.to(dtype), w)
                    if want_w:
                        grad_w += torch.matmul(g.t(), xs.float())
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total, _grad_argmax):
        grad_x, grad_w = ctx.saved_tensors
        return (
            grad_x * grad_total.to(grad_x.dtype) if grad_x is not None else None,
            grad_w.mul(grad_total).to(ctx.weight_dtype) if grad_w is not None else None,
            None, None, None,
        )


def soft_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, p: torch.Tensor, rows: torch.Tensor, *, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i CE(p[rows[i]], softmax(weight @ x_i)), argmax_v (weight @ x_i))`` for ``x`` ``[N, h]``,
    ``weight`` ``[V, h]``, ``p`` ``[R, V]`` (each row a distribution, or zero) indexed by ``rows`` ``[N]``:
    the value and gradients of ``-(p[rows] * log_softmax(x @ weight.T)).sum()``, without the ``[N, V]``
    tensors (:class:`_SoftCrossEntropy`), ``chunk`` rows at a time (default ``CE_CHUNK_ROWS`` on a CPU,
    ``CE_CHUNK_ROWS_GPU`` elsewhere). Under ``torch.no_grad`` no gradient is formed."""
    if chunk is None:
        chunk = CE_CHUNK_ROWS if x.device.type == "cpu" else CE_CHUNK_ROWS_GPU
    if not torch.is_grad_enabled():  # a Function still sees requires_grad inputs as needing gradients there
        x, weight = x.detach(), weight.detach()
    return _SoftCrossEntropy.apply(x, weight, p, rows, chunk)


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
    # The LM-head logits dominate a step (infra/bench/train_step.py), so both distributions are computed only
    # where the loss counts. Depth k's origin j reads p at f_{j+k+1} and counts when x_{j+k+2} is an assistant
    # token: p is needed at t - 1 for every assistant token t, the same positions at every depth.
    # With ce_fraction < 1 the cross-entropy (and p) is computed at a random share of those positions, the same
    # positions at every depth, and averaged over them: an estimate of the full mean at that share of the
    # LM-head cost. The feature regression still counts every position.
    with torch.no_grad():
        needed = torch.zeros_like(loss_mask, dtype=torch.bool)
        needed[:, :-1] = loss_mask[:, 1:].bool()
        if config.ce_fraction < 1.0:
            needed &= torch.rand(needed.shape, device=needed.device) < config.ce_fraction
        row_of = torch.full(loss_mask.shape, -1, dtype=torch.long, device=loss_mask.device)
        row_of[needed] = torch.arange(int(needed.sum()), device=loss_mask.device)
        target_p = torch.softmax(head.target_logits(features[needed]), dim=-1)  # [rows, V] on the draft rows, once
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
        row = _shift(row_of, k + 1)  # the row of p(. | f_{j+k+1}); -1 where it was not computed
        sampled = valid & (row >= 0)  # = valid when ce_fraction is 1
        cross_entropy, drafted = soft_cross_entropy(head.draft_input(predicted[sampled]), head.draft_weight, target_p, row[sampled])
        scored = sampled.sum().clamp(min=1)
        token_loss = cross_entropy / scored
        weight = config.depth_decay**k
        total = total + weight * (config.w_feature * feature_loss + config.w_token * token_loss)
        weight_sum += weight
        with torch.no_grad():
            metrics[f"acc_{k + 1}"] = float((drafted == truth[sampled]).sum() / scored)
        if k == 0:
            metrics["feature_loss"] = float(feature_loss.detach())
            metrics["token_loss"] = float(token_loss.detach())
    loss = total / weight_sum
    metrics["loss"] = float(loss.detach())
    return loss, metrics


@torch.no_grad()
def target_greedy(target, features: torch.Tensor) -> torch.Tensor:
    """The target's own argmax after each position of ``features`` ``[B, n, h]`` (``[B, n]``, a row at a time
    to bound the logits' memory): what greedy verification accepts, ``rollout_metrics``'s ``greedy``."""
    return torch.stack([target.logits(row.to(target.dtype)).argmax(-1) for row in features])


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

