"""Verification: which drafted tokens the target accepts, and the token it adds.

Glossary (as in vLLM's ``rejection_sampler.py``):

* **accepted token** — a draft token the target keeps; the accepted tokens of one step form a path from
  the root down the tree.
* **rejected token** — a draft token the target refuses; the path stops at its parent.
* **bonus token** — the one token the target itself contributes at the end of the accepted path, drawn from
  its own (residual) distribution there. A step therefore always yields ``accepted + 1`` tokens, so plain
  decoding is the special case of a tree with no draft nodes.

Greedy: walk down the tree while some child equals the target's argmax at the current node; the bonus is
the argmax where the walk stops. The output is the target's greedy output, token for token.

Sampling (T > 0): the draft tree's children are the head's top-ranked tokens, a deterministic function of
the context, so each sibling is a point-mass proposal q = 1{x}. Recursive rejection over siblings
(SpecInfer, Miao et al. 2023, arXiv 2305.09781; EAGLE, arXiv 2401.15077, section 4.2 and its reference
``evaluate_posterior``) then reads: with the target's processed distribution p at the node, accept child
x with probability min(1, p(x)/q(x)) = p(x); on rejection, the residual is norm(max(p - q, 0)), i.e. p with
x removed and renormalised; try the next sibling against that residual; if every sibling is rejected (or
the node is a leaf), draw the bonus token from the final residual. Each emitted token is then exactly
distributed as p conditioned on the prefix — lossless for any head.

Processing of the target's logits (temperature, then top-k, then top-p) is the same function plain
decoding samples from, so "the target's distribution" means the processed one. It is computed only for
the nodes the walk visits (``ProcessedRows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.errors import EagleError
from eagle.tree import DraftTree


MIN_TEMPERATURE = 1e-3  # a positive temperature below this is refused: 1/T would overflow fp32 logits into inf/NaN


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next-token distribution is processed.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it (at least ``MIN_TEMPERATURE``).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise EagleError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, inf), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise EagleError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise EagleError(f"top_k must be >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The target's processed distribution ``[..., V]`` (float32) for logits ``[..., V]``; T must be > 0."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@dataclass
class Acceptance:
    """Result of verifying one tree: accepted node indices (root excluded, top-down) and the bonus token."""

    path: list[int]
    bonus_token: int


def greedy_verify(tree: DraftTree, greedy: torch.Tensor) -> Acceptance:
    """Longest path whose every token equals the target's argmax at its parent; ``greedy``: the target's
    argmax at every node ``[N]``. Vectorised: a node is reachable when it and every ancestor below the root
    match, the accepted node is the deepest reachable one; one transfer to the host at the end."""
    tokens, parents = tree.tokens, tree.parents
    matches = torch.ones_like(tokens, dtype=torch.bool)
    matches[1:] = tokens[1:] == greedy[parents[1:]]  # [N]
    reachable = (tree.ancestors <= matches).all(dim=-1)  # every ancestor (incl. itself) matches
    node = int(torch.where(reachable, tree.depths, -1).argmax())
    path = tree.ancestors[node].nonzero().squeeze(-1)[1:]  # ascending = top-down; drop the root
    return Acceptance(path.tolist(), int(greedy[node]))


class ProcessedRows:
    """The target's processed distribution, computed per node on first read: recursive rejection reads the
    rows of the accepted path only, so ``processed_probs`` (softmax, top-k, top-p over the vocabulary) runs
    depth + 1 times per step instead of once per tree node. ``rows[node]`` is a ``[V]`` row,
    ``rows[node, token]`` one probability."""

    def __init__(self, logits: torch.Tensor, sampling: SamplingConfig) -> None:
        self.logits = logits  # [N, V]
        self.sampling = sampling
        self._rows: dict[int, torch.Tensor] = {}
        self.computed = 0

    def __getitem__(self, index):
        node, token = index if isinstance(index, tuple) else (index, None)
        row = self._rows.get(node)
        if row is None:
            row = self._rows[node] = processed_probs(self.logits[node], self.sampling)
            self.computed += 1
        return row if token is None else row[token]


def sample_verify(tree: DraftTree, probs, generator: torch.Generator | None) -> Acceptance:
    """Recursive rejection over siblings (point-mass proposals); ``probs[node]``: the target's processed
    distribution ``[V]`` at a node (a ``[N, V]`` tensor or ``ProcessedRows``)."""
    tokens = tree.host[0]
    children = tree.children
    node, path = 0, []
    while True:
        residual = probs[node].clone()  # p at this node, kept unnormalised: mass = residual.sum()
        accepted = None
        for child in children[node]:
            token = tokens[child]
            u = torch.rand((), generator=generator, device=residual.device)
            mass = residual.sum()
            if u * mass < residual[token] or residual[token] >= mass:  # accept w.p. p'(x) / q(x), q(x) = 1
                accepted = child
                break
            residual[token] = 0.0  # residual norm(max(p' - q, 0)): x removed
        if accepted is None:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return Acceptance(path, bonus)
        path.append(accepted)
        node = accepted


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a processed distribution ``[V]``."""
    return int(torch.multinomial(probs, 1, generator=generator))
