"""Draft heads of known quality for the losslessness tests: a trained ("good") head and a wrong one.

``good_head(target)`` trains an EAGLE head on the target's own continuations for a few hundred Adam steps
(seconds on a tiny target) with the project's EAGLE loss (``eagle.loss.eagle_loss``, without input noise so
the heads are exactly repeatable). Trained heads are cached per target so every test reuses them.

``wrong_head(target)`` is the trained head with its draft distribution reversed: in every context it drafts
the tokens it finds *least* likely, so its drafts are (almost) never the target's greedy choice and the
verifier must reject nearly everything. (A context-free wrong head, e.g. a constant output aimed at rarely
chosen tokens, does not work on tiny random targets: across contexts nearly every token is somebody's argmax.)

Does not own: decoding or verification; these heads only exist to exercise them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from eagle.head import EagleHead
from eagle.target import Target
from eagle.loss import LossConfig, eagle_loss

logger = logging.getLogger(__name__)

_TRAINED: dict[tuple, dict[str, torch.Tensor]] = {}  # target key + seed -> trained head state


def _target_key(target: Target, seed: int) -> tuple:
    """(arch, vocab, seed) plus a weight fingerprint, so two tiny targets with other weights never collide."""
    fingerprint = round(float(target.lm_head.weight.double().abs().sum()), 6)
    return (target.config.model_type, target.vocab_size, seed, target.hidden_size, target.config.num_hidden_layers, fingerprint)


@torch.no_grad()
def continuations(target: Target, *, sequences: int, length: int, prompt_len: int = 4, temperature: float, seed: int) -> torch.Tensor:
    """``[sequences, length]`` token ids: random prompts continued by the target (temperature 0 = greedy)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (sequences, prompt_len), generator=generator)
    while ids.shape[1] < length:
        logits = target.model(input_ids=ids.to(target.device)).logits[:, -1].double().cpu()  # [B, V]
        if temperature == 0:
            next_token = logits.argmax(-1, keepdim=True)  # [B, 1]
        else:
            next_token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        ids = torch.cat([ids, next_token], dim=1)
    return ids


def target_features(target: Target, tokens: torch.Tensor, head: EagleHead) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final features ``[B, n, h]``, the EAGLE-3 head's fused input ``[B, n, 3h]`` or None) for ``tokens``."""
    with torch.no_grad():
        out = target.backbone(input_ids=tokens, output_hidden_states=True)
    layers = head.config.head_layers
    return out.last_hidden_state, (torch.cat([out.hidden_states[i] for i in layers], dim=-1) if layers else None)


def train_head(
    target: Target, *, seed: int = 0, steps: int = 300, lr: float = 1e-2, temperature: float = 1.0, sequences: int = 32, length: int = 40,
    kind: str = "eagle1",
) -> EagleHead:
    """A head of ``kind`` trained with its EAGLE loss on greedy and sampled continuations of random prompts."""
    head = EagleHead.for_target(target, seed=seed, kind=kind)
    head.train()
    greedy = continuations(target, sequences=sequences // 2, length=length, temperature=0.0, seed=seed)
    sampled = continuations(target, sequences=sequences - sequences // 2, length=length, temperature=temperature, seed=seed + 1)
    tokens = torch.cat([greedy, sampled]).to(target.device)  # [B, n]
    features, inputs = target_features(target, tokens, head)  # f_0..f_{n-1}
    loss_mask = torch.ones_like(tokens)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    # exact, repeatable heads for the losslessness tests (no input noise); eagle3: a 3-step training-time test
    config = LossConfig.for_kind(kind, noise=0.0, depth=3 if kind == "eagle3" else None)
    with single_thread(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for _ in range(steps):
            loss, _ = eagle_loss(head, features, tokens, loss_mask, config, inputs=inputs)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    logger.info("trained head for %s: final loss %.4f", target.name, float(loss.detach()))
    head.eval()
    head.requires_grad_(False)
    return head


def good_head(target: Target, *, seed: int = 0, kind: str = "eagle1") -> EagleHead:
    """A trained head of ``kind`` for ``target``, trained once per (arch, vocab, seed, weights, kind) and reused."""
    key = (*_target_key(target, seed), kind)
    if key not in _TRAINED:
        _TRAINED[key] = {k: v.clone() for k, v in train_head(target, seed=seed, kind=kind).state_dict().items()}
    head = EagleHead.for_target(target, seed=seed, kind=kind)
    head.load_state_dict(_TRAINED[key])
    head.eval()
    return head


class _ReversedHead(EagleHead):
    """A trained head whose draft distribution is reversed: it ranks first what it finds least likely."""

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return -super().draft_logits(hidden)


def wrong_head(target: Target, *, seed: int = 0) -> EagleHead:
    """A head that drafts the tokens a trained head rates *least* likely in the current context, so its
    drafts are (almost) never the target's greedy choice and the verifier must reject nearly everything."""
    trained = good_head(target, seed=seed)
    head = _ReversedHead(trained.config)
    head.load_state_dict(trained.state_dict())
    head = head.to(device=target.device, dtype=target.dtype).attach(target)
    head.eval()
    return head


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread: the tiny targets' matmuls are far faster without thread hand-offs, the more
    so on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
