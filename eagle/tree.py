"""Draft trees: their shape, their attention mask and positions, and how the head drafts them.

Owns: ``DraftTree`` (node 0 is the root — the last token the target already chose, whose KV entry the
target has not computed yet; every other node is a draft token), the tree attention mask and position
ids shared by the head and the target, and two drafting policies:

* ``StaticTree`` — EAGLE-1's fixed tree (Li et al., arXiv 2401.15077, section 4.2), given as paths of
  child *ranks*: ``(0, 1)`` is "the 2nd most likely child of the most likely depth-1 token". The default
  is the reference's ``mc_sim_7b_63`` tree: 25 nodes, depth 5.
* ``DynamicTree`` — EAGLE-2 (Li et al., arXiv 2406.16858, section 4): at every depth, expand the
  ``top_k`` nodes with the highest cumulative draft log-probability, each proposing its ``top_k`` best
  children; after ``depth`` levels rerank every drafted node by cumulative log-probability and keep the
  ``total_tokens`` best (a child never outranks its parent, so the kept set is a tree).

Does not own: accepting tokens (``verify.py``) or the decode loop (``generate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from eagle.errors import EagleError
from eagle.target import crop_cache

if TYPE_CHECKING:
    from eagle.head import EagleHead

# EAGLE-1's default static tree (``mc_sim_7b_63`` in the reference repo): paths of child ranks.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)  # fmt: skip


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of child ranks (EAGLE-1). ``paths`` must be prefix-closed."""

    paths: tuple[tuple[int, ...], ...] = MC_SIM_7B_63

    def __post_init__(self) -> None:
        known = set(self.paths)
        for path in self.paths:
            if not path or any(r < 0 for r in path):
                raise EagleError(f"static tree path {path} is empty or has a negative rank")
            if len(path) > 1 and path[:-1] not in known:
                raise EagleError(f"static tree is not prefix-closed: {path} has no parent {path[:-1]}")

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def size(self) -> int:
        return len(self.paths)

    def child_ranks(self, path: tuple[int, ...]) -> list[int]:
        return sorted(p[-1] for p in self.paths if len(p) == len(path) + 1 and p[:-1] == path)


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's context-aware tree.

    Attributes:
        depth: draft levels (head forwards per step after the first).
        top_k: nodes expanded per level, and children proposed per expanded node.
        total_tokens: draft tokens kept after reranking (the verification forward is 1 + this).
    """

    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise EagleError("dynamic tree needs depth, top_k and total_tokens >= 1")

    @property
    def size(self) -> int:
        return self.total_tokens


TreeSpec = Union[StaticTree, DynamicTree]


@dataclass
class DraftTree:
    """A drafted tree. Node 0 is the root; ``parents[i] < i`` for every other node.

    Children are stored in rank order (most likely first), which the sampling verifier relies on.
    """

    tokens: torch.Tensor  # [N] target token ids
    parents: list[int]  # [N], parents[0] == -1
    depths: torch.Tensor  # [N] long, depths[0] == 0

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return kids

    def ancestor_matrix(self) -> torch.Tensor:
        """``[N, N]`` bool: entry (i, j) is True iff node j is node i or one of its ancestors."""
        n = len(self.parents)
        matrix = torch.zeros(n, n, dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                matrix[node] = matrix[parent]
            matrix[node, node] = True
        return matrix

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive mask ``[1, 1, N, prefix_len + N]``: every node sees the prefix and its own ancestry."""
        allowed = torch.cat(
            [torch.ones(len(self), prefix_len, dtype=torch.bool), self.ancestor_matrix()], dim=1
        ).to(device)
        return additive_mask(allowed, dtype)

    def position_ids(self, start: int) -> torch.Tensor:
        """``[1, N]``: the root sits at ``start``, a node at depth d at ``start + d``."""
        return (self.depths + start).unsqueeze(0)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (root excluded)."""
        path = []
        while node > 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def causal_mask(q: int, past: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive ``[1, 1, q, past + q]`` causal mask for ``q`` new positions after ``past`` cached ones."""
    return additive_mask(torch.ones(q, past + q, dtype=torch.bool, device=device).tril(diagonal=past), dtype)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[q, kv]`` (True = may attend) -> additive ``[1, 1, q, kv]`` in ``dtype``."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def draft_tree(
    head: "EagleHead",
    cache,
    last_hidden: torch.Tensor,  # [hidden]: head output at the root's position (predicts the root's feature)
    root_token: int,
    prefix_len: int,
    spec: TreeSpec,
) -> DraftTree:
    """Draft a tree below ``root_token`` with ``head``; the head cache is left at ``prefix_len``.

    The head cache holds ``prefix_len`` committed positions; the root's pair (f_{L-1}, root) is the last of
    them. A node fed to the head sits at position ``prefix_len + depth - 1`` and takes its parent's
    predicted feature and its own token; its output is its own predicted feature, whose LM-head
    distribution proposes its children.
    """
    static = isinstance(spec, StaticTree)
    device = last_hidden.device
    tokens: list[int] = [root_token]
    parents: list[int] = [-1]
    depths: list[int] = [0]
    scores: list[float] = [0.0]
    paths: list[tuple[int, ...]] = [()]
    fed_slot: dict[int, int] = {}  # node -> index of its head-cache slot after the prefix
    feature: dict[int, torch.Tensor] = {0: last_hidden.reshape(-1)}
    expand = [0]
    expand_logp = torch.log_softmax(head.draft_logits(last_hidden.reshape(1, -1)), dim=-1)  # [1, Vd]
    max_rank = spec.top_k if not static else 1 + max(r for p in spec.paths for r in p)

    for depth in range(1, spec.depth + 1):
        top = expand_logp.topk(min(max_rank, expand_logp.shape[-1]), dim=-1)  # [E, k]
        top_ids = head.draft_to_target(top.indices)
        new_nodes: list[int] = []
        for row, parent in enumerate(expand):
            ranks = spec.child_ranks(paths[parent]) if static else range(top_ids.shape[1])
            for rank in ranks:
                if rank >= top_ids.shape[1]:
                    continue
                tokens.append(int(top_ids[row, rank]))
                parents.append(parent)
                depths.append(depth)
                scores.append(scores[parent] + float(top.values[row, rank]))
                paths.append(paths[parent] + (rank,))
                new_nodes.append(len(tokens) - 1)
        if depth == spec.depth or not new_nodes:
            break
        if static:
            to_feed = [n for n in new_nodes if spec.child_ranks(paths[n])]
        else:
            to_feed = sorted(new_nodes, key=lambda n: -scores[n])[: spec.top_k]
        if not to_feed:
            break
        hidden = _feed(head, cache, prefix_len, depth, to_feed, parents, tokens, feature, fed_slot, device)
        for row, node in enumerate(to_feed):
            feature[node] = hidden[row]
        expand = to_feed
        expand_logp = torch.log_softmax(head.draft_logits(hidden), dim=-1)  # [E, Vd]

    crop_cache(cache, prefix_len)
    keep = list(range(1, len(tokens))) if static else _rerank(parents, depths, scores, spec.total_tokens)
    return _build(keep, tokens, parents, depths, device)


def _feed(head, cache, prefix_len, depth, to_feed, parents, tokens, feature, fed_slot, device) -> torch.Tensor:
    """Run the head over the nodes ``to_feed`` (all at ``depth``); return their outputs ``[E, hidden]``."""
    slots_before = len(fed_slot)
    q = len(to_feed)
    allowed = torch.zeros(q, prefix_len + slots_before + q, dtype=torch.bool)
    allowed[:, :prefix_len] = True
    for row, node in enumerate(to_feed):
        allowed[row, prefix_len + slots_before + row] = True
        ancestor = parents[node]
        while ancestor > 0:
            allowed[row, prefix_len + fed_slot[ancestor]] = True
            ancestor = parents[ancestor]
    for row, node in enumerate(to_feed):
        fed_slot[node] = slots_before + row
    features = torch.stack([feature[parents[n]] for n in to_feed]).unsqueeze(0)  # [1, E, hidden]
    token_ids = torch.tensor([[tokens[n] for n in to_feed]], device=device)  # [1, E]
    positions = torch.full((1, q), prefix_len + depth - 1, dtype=torch.long, device=device)
    mask = additive_mask(allowed.to(device), features.dtype)
    return head(features, token_ids, cache, positions, mask)[0]


def _rerank(parents: list[int], depths: list[int], scores: list[float], total: int) -> list[int]:
    """EAGLE-2 reranking: the ``total`` best nodes by cumulative log-prob, closed under parents."""
    order = sorted(range(1, len(parents)), key=lambda n: (-scores[n], depths[n], n))
    kept: set[int] = {0}
    keep: list[int] = []
    for node in order:
        if len(keep) == total:
            break
        if parents[node] in kept:
            kept.add(node)
            keep.append(node)
    return keep


def _build(keep: list[int], tokens, parents, depths, device) -> DraftTree:
    """Reindex kept nodes by (depth, draft order) so parents precede children and siblings keep rank order."""
    keep = sorted(keep, key=lambda n: (depths[n], n))
    new_index = {0: 0}
    for i, node in enumerate(keep, start=1):
        new_index[node] = i
    return DraftTree(
        tokens=torch.tensor([tokens[0]] + [tokens[n] for n in keep], device=device),
        parents=[-1] + [new_index[parents[n]] for n in keep],
        depths=torch.tensor([0] + [depths[n] for n in keep], device=device),
    )


def root_only(root_token: int, device: torch.device | str = "cpu") -> DraftTree:
    """The empty draft: plain decoding verifies just the root."""
    return DraftTree(tokens=torch.tensor([root_token], device=device), parents=[-1], depths=torch.zeros(1, dtype=torch.long, device=device))
