"""ShareGPT parsing, deterministic splits and assistant-only loss masks."""

import json

import pytest
from transformers import AutoTokenizer

from eagle.data import Conversation, iter_records, load_sharegpt, normalise, split, tokenize
from eagle.errors import EagleError
from eagle.target import materialize_builtin


def _record(i, *turns):
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_truncated_array_yields_every_complete_record(tmp_path):
    records = [_record(i, ("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"a2"')])  # the third record is cut mid-way
    assert [r["id"] for r in iter_records(path)] == ["c0", "c1"]
    path.write_text(text)
    assert [r["id"] for r in iter_records(path)] == ["c0", "c1", "c2"]


def test_normalise_keeps_clean_alternations_only():
    conv = normalise(_record(1, ("gpt", "hello"), ("human", "q"), ("gpt", "a"), ("human", "dangling")))
    assert conv == Conversation("c1", (("user", "q"), ("assistant", "a")))
    assert normalise(_record(2, ("human", "q"), ("human", "q again"), ("gpt", "a"))) is None
    assert normalise(_record(3, ("human", "q"), ("bing", "a"))) is None
    assert normalise(_record(4, ("human", "q"), ("gpt", "  "))) is None
    assert normalise(_record(5, ("human", "only a question"))) is None


def test_split_is_deterministic_by_id_and_order_free():
    conversations = [Conversation(f"id-{i}", (("user", "q"), ("assistant", "a"))) for i in range(2000)]
    train, held_out = split(conversations, 0.1)
    train_rev, held_rev = split(conversations[::-1], 0.1)
    assert {c.id for c in held_out} == {c.id for c in held_rev}
    assert not {c.id for c in train} & {c.id for c in held_out}
    assert 140 < len(held_out) < 260  # ~10 % of 2000 (binomial sd ~13)
    with pytest.raises(EagleError):
        split(conversations, 1.5)


@pytest.fixture(scope="module")
def tokenizer():
    directory, _ = materialize_builtin("smollm2-135m")
    return AutoTokenizer.from_pretrained(directory)


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    conv = Conversation("x", (("user", "What is 2+2?"), ("assistant", "It is 4."), ("user", "And 3+3?"), ("assistant", "Six.")))
    tokenized = tokenize(tokenizer, conv)
    assert len(tokenized.input_ids) == len(tokenized.loss_mask)
    runs, current = [], []
    for token, masked in zip(tokenized.input_ids, tokenized.loss_mask):
        if masked:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    assert runs == ["It is 4.<|im_end|>", "Six.<|im_end|>"]
    assert tokenize(tokenizer, conv, max_length=5).input_ids == tokenized.input_ids[:5]


def test_real_sharegpt_recovers_the_complete_conversations():
    conversations = load_sharegpt()
    assert 17_000 < len(conversations) <= 17_671  # 17,671 complete records, a few with broken roles dropped
    assert all(c.turns[0][0] == "user" and c.turns[-1][0] == "assistant" for c in conversations)
    assert len(load_sharegpt(limit=5)) == 5
