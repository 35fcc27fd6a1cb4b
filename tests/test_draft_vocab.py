"""Reduced draft vocabulary (EAGLE-3 d2t/t2d): built from counts, drafts only its tokens, stays lossless."""

import pytest
import torch

from eagle import Decoder, DynamicTree, EagleError, EagleHead, GenerationConfig, StaticTree
from eagle.batch import BatchDecoder
from eagle.head import draft_vocab_from_counts
from tiny import tiny_target


def test_most_frequent_tokens_win_and_forced_tokens_stay():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    assert draft_vocab_from_counts(counts, 3).tolist() == [2, 3, 5]
    assert draft_vocab_from_counts(counts, 3, always=[6]).tolist() == [2, 3, 6]  # tie 9/9 keeps the smaller id
    with pytest.raises(EagleError, match="draft vocabulary size"):
        draft_vocab_from_counts(counts, 0)


@pytest.mark.parametrize("tree", [StaticTree(), DynamicTree(depth=4, top_k=3, total_tokens=12)])
def test_reduced_vocab_head_drafts_inside_its_vocabulary_and_matches_plain(tree):
    target = tiny_target("llama", logit_scale=3.0)
    prompt = [3, 9, 27, 4, 18, 40, 7, 11]
    config = GenerationConfig(max_new_tokens=40, stop_token_ids=[])
    plain = Decoder(target).generate(prompt, config)
    counts = torch.bincount(torch.tensor(plain.token_ids + prompt), minlength=target.vocab_size)
    vocab = draft_vocab_from_counts(counts, 16)
    head = EagleHead.for_target(target, seed=1, draft_token_ids=vocab)
    assert head.t2d.sum() == 16 and head.draft_to_target(torch.arange(16)).tolist() == vocab.tolist()

    decoder = Decoder(target, head, tree)
    engine = BatchDecoder(decoder, max_batch=1, max_context=64)
    engine.submit(prompt, config)
    engine.admit()
    drafted, = engine.draft()
    assert set(drafted.tokens[1:].tolist()) <= set(vocab.tolist())
    assert decoder.generate(prompt, config).token_ids == plain.token_ids
