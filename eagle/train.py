"""One training step any trainer can call (a plain loop, a DeepSpeed engine), and what feeds it: token-budget
batches of feature records, padding, the optimizer and the warmup schedule of EAGLE (arXiv 2401.15077,
section 5: AdamW(β1=0.9, β2=0.95), gradient clipping at 0.5).

A record is a dict with ``input_ids`` ``[n]``, ``loss_mask`` ``[n]`` and ``features`` ``[n, h]`` (the target's
last hidden state at every position, as written by the feature job or computed online), and for EAGLE-3
heads ``aux_features`` ``[n, 3h]`` (the fused low / middle / high streams the head reads).

Does not own: distribution, checkpoints, logging backends (``jobs/train_head.py``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle.head import EagleHead
from eagle.loss import LossConfig, eagle_loss


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, n] long, right-padded with 0
    loss_mask: torch.Tensor  # [B, n] (0 on padding)
    features: torch.Tensor  # [B, n, h]
    aux_features: torch.Tensor | None = None  # [B, n, 3h]: an EAGLE-3 head's input

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.shape[0] * self.loss_mask.shape[1])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Batch":
        move = lambda t: None if t is None else t.to(device=device, dtype=dtype or t.dtype)  # noqa: E731
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), move(self.features), move(self.aux_features))


def collate(records: Sequence[dict[str, torch.Tensor]], max_length: int | None = None) -> Batch:
    """Right-pad records into a batch (padding carries no loss; causal attention keeps it out of real rows).
    Records without ``features`` (online training computes them from ``input_ids``) get an empty
    ``[b, n, 0]`` placeholder."""
    lengths = [min(int(r["input_ids"].shape[0]), max_length or 1 << 30) for r in records]
    stored = "features" in records[0]
    n = max(lengths)
    hidden = int(records[0]["features"].shape[-1]) if stored else 0
    ids = torch.zeros(len(records), n, dtype=torch.long)
    mask = torch.zeros(len(records), n, dtype=torch.long)
    feats = torch.zeros(len(records), n, hidden, dtype=records[0]["features"].dtype if stored else torch.float32)
    aux = None
    if stored and "aux_features" in records[0]:
        aux = torch.zeros(len(records), n, int(records[0]["aux_features"].shape[-1]), dtype=records[0]["aux_features"].dtype)
    for i, (record, length) in enumerate(zip(records, lengths)):
        ids[i, :length] = record["input_ids"][:length].long()
        mask[i, :length] = record["loss_mask"][:length].long()
        if stored:
            feats[i, :length] = record["features"][:length]
        if aux is not None:
            aux[i, :length] = record["aux_features"][:length]
    return Batch(ids, mask, feats, aux)


def token_budget_batches(lengths: Sequence[int], batch_tokens: int, *, seed: int, epoch: int) -> list[list[int]]:
    """Indices grouped so that ``len(batch) * longest <= batch_tokens`` (padding stays small: records are
    sorted by length inside random windows), batches shuffled per epoch, deterministic in (seed, epoch)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 64
    batches: list[list[int]] = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        current: list[int] = []
        longest = 0
        for index in chunk:
            longest_if = max(longest, lengths[index])
            if current and longest_if * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current, longest_if = [], lengths[index]
            current.append(index)
            longest = longest_if
        if current:
            batches.append(current)
    rng.shuffle(batches)
    return batches


def lr_factor(step: int, *, warmup: int, progress: float) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps to 1, then linear decay to 0.1 as ``progress``
    (the fraction of the post-warmup budget used, by steps or by wall clock) goes from 0 to 1."""
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    return 1.0 - 0.9 * min(1.0, max(0.0, progress))


def warmup_linear(step: int, *, warmup: int, total: int) -> float:
    """:func:`lr_factor` with progress counted in steps out of ``total``."""
    return lr_factor(step, warmup=warmup, progress=(step - warmup) / (total - warmup) if total > warmup else 0.0)


def build_optimizer(head: EagleHead, *, lr: float, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over the head's own parameters (the borrowed embedding and LM head are not parameters)."""
    params = [p for p in head.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def compute_loss(head: EagleHead, batch: Batch, config: LossConfig, *, autocast_bf16: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The forward half of a step: loss and metrics for one batch (bf16 autocast optional)."""
    device = next(head.parameters()).device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        return eagle_loss(head, batch.features, batch.input_ids, batch.loss_mask, config, inputs=batch.aux_features)


def train_step(
    head: EagleHead, optimizer: torch.optim.Optimizer, batch: Batch, config: LossConfig, *, clip: float = 0.5, autocast_bf16: bool = False
) -> dict[str, float]:
    """A full plain-PyTorch step (forward, backward, clip, optimizer step); DeepSpeed callers use
    :func:`compute_loss` with the engine's ``backward``/``step`` instead."""
    head.train()
    loss, metrics = compute_loss(head, batch, config, autocast_bf16=autocast_bf16)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], clip)
    optimizer.step()
    metrics["grad_norm"] = float(norm) if math.isfinite(float(norm)) else float("nan")
    return metrics
