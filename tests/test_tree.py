"""Tree attention: masks, positions, path scoring, and KV-cache compaction against fresh prefills."""

import pytest
import torch

from eagle import Decoder, EagleHead, GenerationConfig, StaticTree, DynamicTree
from eagle.errors import EagleError
from eagle.target import compact_cache
from eagle.tree import DraftTree, MC_SIM_7B_63, causal_mask, draft_tree
from tiny import ARCHITECTURES, tiny_target

PROMPT = [5, 17, 3, 42, 8, 23, 11, 60, 2, 31]


def _random_tree(size: int, vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for node in range(1, size):
        parent = int(torch.randint(0, node, (1,), generator=g))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return DraftTree(torch.randint(0, vocab, (size,), generator=g), parents, torch.tensor(depths))


def _leaves(tree: DraftTree) -> list[int]:
    return [n for n, kids in enumerate(tree.children) if not kids]


def test_mask_lets_each_node_see_prefix_and_ancestry_only():
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 4]), [-1, 0, 0, 1, 3], torch.tensor([0, 1, 1, 2, 3]))
    allowed = tree.attention_mask(prefix_len=3, dtype=torch.float32)[0, 0] == 0
    expected = torch.tensor(
        [
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 1, 0, 0],
            [1, 1, 1, 1, 1, 0, 1, 0],
            [1, 1, 1, 1, 1, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
    assert tree.position_ids(3).tolist() == [[3, 4, 4, 5, 6]]
    assert tree.path_to(4) == [1, 3, 4]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_tree_forward_scores_every_path_like_sequential_decoding(model_type):
    target = tiny_target(model_type)
    tree = _random_tree(14, target.vocab_size, seed=3)
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache)
    n = len(PROMPT)
    features = target.forward(tree.tokens[None], cache, tree.position_ids(n), tree.attention_mask(n, target.dtype))[0]
    leaves = _leaves(tree)
    assert len(leaves) >= 3
    for leaf in leaves:
        path = [0] + tree.path_to(leaf)
        sequence = PROMPT + tree.tokens[path].tolist()
        fresh = target.forward(torch.tensor([sequence]), target.new_cache())[0, n:]
        torch.testing.assert_close(features[path], fresh, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_compacted_cache_equals_fresh_prefill_of_accepted_tokens(model_type):
    target = tiny_target(model_type)
    tree = _random_tree(12, target.vocab_size, seed=5)
    n = len(PROMPT)
    cache = target.new_cache()
    target.forward(torch.tensor([PROMPT]), cache)
    target.forward(tree.tokens[None], cache, tree.position_ids(n), tree.attention_mask(n, target.dtype))
    leaf = max(_leaves(tree), key=lambda node: len(tree.path_to(node)))
    keep = [0] + tree.path_to(leaf)[:-1]  # an accepted path that stops above the leaf
    compact_cache(cache, n, torch.tensor(keep) + n)
    fresh = target.new_cache()
    target.forward(torch.tensor([PROMPT + tree.tokens[keep].tolist()]), fresh)
    assert cache.get_seq_length() == n + len(keep)
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(got.values, want.values, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("tree_spec", [StaticTree(), DynamicTree(depth=4, top_k=3, total_tokens=10)])
def test_decode_loop_keeps_both_caches_equal_to_fresh_prefills(tree_spec):
    """After every step the target cache holds exactly the committed tokens, and the head cache equals a
    fresh head prefill over the target's true features of those tokens."""
    target = tiny_target("llama", logit_scale=4.0)
    head = EagleHead.for_target(target, seed=2)
    decoder = Decoder(target, head, tree_spec)
    config = GenerationConfig(max_new_tokens=40, stop_token_ids=[])
    state = decoder._prefill(PROMPT, config.sampling, None)
    committed = list(PROMPT)
    for _ in range(6):
        tree = decoder._draft(state)
        assert state.head_cache.get_seq_length() == state.committed  # drafting leaves no residue
        keep, kept_features, new_tokens = decoder._verify(state, tree, config.sampling, None)
        start = state.committed
        committed += [state.root] + new_tokens[:-1]
        state.committed += len(keep)
        state.root = new_tokens[-1]
        decoder._advance_head(state, start, kept_features, new_tokens)

        fresh = target.new_cache()
        features = target.forward(torch.tensor([committed]), fresh)
        for got, want in zip(state.target_cache.layers, fresh.layers):
            torch.testing.assert_close(got.keys, want.keys, rtol=1e-9, atol=1e-9)
        head_cache = head.new_cache()
        n = len(committed)
        hidden = head(features, torch.tensor([committed[1:] + [state.root]]), head_cache, torch.arange(n)[None], causal_mask(n, 0, target.dtype))
        torch.testing.assert_close(state.head_cache.layers[0].keys, head_cache.layers[0].keys, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(state.last_hidden, hidden[0, -1], rtol=1e-8, atol=1e-8)


def test_static_default_is_the_reference_25_node_depth_5_tree():
    spec = StaticTree()
    assert spec.size == 25 and spec.depth == 5 and spec.paths == MC_SIM_7B_63
    target = tiny_target("llama")
    head = EagleHead.for_target(target, seed=0)
    decoder = Decoder(target, head, spec)
    state = decoder._prefill(PROMPT, GenerationConfig().sampling, None)
    tree = draft_tree(head, state.head_cache, state.last_hidden, state.root, state.committed, spec)
    assert len(tree) == 26 and int(tree.depths.max()) == 5
    assert all(tree.parents[i] < i for i in range(1, len(tree)))
    # siblings are distinct tokens
    for kids in tree.children:
        tokens = tree.tokens[kids].tolist()
        assert len(tokens) == len(set(tokens))


def test_dynamic_tree_keeps_the_best_nodes_closed_under_parents():
    target = tiny_target("qwen2", logit_scale=3.0)
    head = EagleHead.for_target(target, seed=0)
    spec = DynamicTree(depth=4, top_k=3, total_tokens=9)
    decoder = Decoder(target, head, spec)
    state = decoder._prefill(PROMPT, GenerationConfig().sampling, None)
    tree = draft_tree(head, state.head_cache, state.last_hidden, state.root, state.committed, spec)
    assert len(tree) == 1 + 9
    assert all(0 <= tree.parents[i] < i for i in range(1, len(tree)))
    assert tree.depths.tolist() == sorted(tree.depths.tolist())


def test_static_tree_must_be_prefix_closed():
    with pytest.raises(EagleError, match="prefix-closed"):
        StaticTree(paths=((0,), (1, 1)))
