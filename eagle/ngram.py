"""Hybrid trees: a branch copied from the context joins the EAGLE tree and is verified in the same forward.

Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) proposes, after the last
``n`` tokens of the context, the tokens that followed their most recent earlier occurrence. Where text
repeats (a second turn rewriting the first answer, code edits, quoting), those copies are long and right,
and a head trained on chat rarely drafts them as far. Here the copy becomes one more branch below the root
of the drafted tree: where its first tokens equal a path the head already drafted it follows that path,
and the rest hangs below it. The verification width does not grow: the branch's new nodes take the places
of the head's least likely nodes (lowest cumulative draft log-probability; those are leaves of the head's
tree, since a child never scores above its parent), so a step costs what an EAGLE step costs, and a
step without a match is exactly an EAGLE step (on this CPU a 16-token forward costs about a 1-token
one, a 24-token one 1.7x: docs/benchmarks.md). Verification is unchanged and stays lossless: greedy acceptance follows the
target's argmax through whichever branch holds it, and recursive rejection treats the branch's nodes as
further deterministic proposals (point masses) among their siblings, as it does the head's.

Owns: ``lookup`` (the n-gram match) and ``add_branch`` (the merge into a ``DraftTree``).
Does not own: drafting (``tree.py``) or verification (``verify.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from eagle.tree import DraftTree

if TYPE_CHECKING:
    from eagle.tree import HybridTree


def lookup(context: Sequence[int], *, max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` tokens that followed the most recent earlier occurrence of the context's last
    ``n`` tokens, for the largest ``n`` in ``max_ngram .. min_ngram`` that occurs; ``[]`` when none does."""
    tokens = np.asarray(context, dtype=np.int64)
    length = tokens.size
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every n-gram that has a successor
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start : start + max_tokens].tolist()
    return []


def add_branch(tree: DraftTree, context: Sequence[int], spec: "HybridTree", width: int | None = None) -> DraftTree:
    """``tree`` plus the n-gram branch below its root (``context`` ends with the root token), in at most
    ``width`` nodes (default: as many as ``tree``). The branch follows existing nodes while their tokens
    agree, then adds new nodes in place of the head's lowest-scored ones; ``tree`` itself when there is no
    match or the head drafted the whole branch already."""
    width = width or len(tree)
    branch = lookup(context, max_ngram=spec.max_ngram, min_ngram=spec.min_ngram, max_tokens=min(spec.branch_tokens, width - 1))
    if not branch:
        return tree
    tokens, parents = tree.host
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents[1:], start=1):
        children.setdefault(parent, {}).setdefault(tokens[node], node)
    node, merged = 0, 0
    while merged < len(branch) and branch[merged] in children.get(node, {}):
        node = children[node][branch[merged]]
        merged += 1
    rest = branch[merged:]
    if not rest:
        return tree
    depths = tree.depths.tolist()
    keep = list(range(len(tokens)))
    excess = len(tokens) + len(rest) - width
    if excess > 0:  # drop the head's lowest-scored nodes off the branch's path (each a leaf once its children go)
        on_path, walk = set(), node
        while walk > 0:
            on_path.add(walk)
            walk = parents[walk]
        scores = tree.scores.tolist() if tree.scores is not None else [-float(d) for d in depths]
        droppable = sorted((n for n in range(1, len(tokens)) if n not in on_path), key=lambda n: (scores[n], -n))
        dropped = set(droppable[:excess])
        keep = [n for n in keep if n not in dropped]
    index = {old: new for new, old in enumerate(keep)}
    first = len(keep)
    new_tokens = [tokens[n] for n in keep] + rest
    new_parents = [-1] + [index[parents[n]] for n in keep[1:]] + [index[node]] + list(range(first, first + len(rest) - 1))
    new_depths = [depths[n] for n in keep] + list(range(depths[node] + 1, depths[node] + 1 + len(rest)))
    device = tree.tokens.device
    return DraftTree(
        torch.tensor(new_tokens, dtype=tree.tokens.dtype, device=device),
        torch.tensor(new_parents, dtype=torch.long, device=device),
        torch.tensor(new_depths, dtype=torch.long, device=device),
    )
