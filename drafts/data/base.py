"""What a training source yields: prompts as users send them, never answers.

Every answer a draft trains on is the target's own (self-distillation), so a source only says
what users ask: the user turns of a chat (each rendered with the target's chat template, the
target answering each one in turn) or a plain-text prompt sent as is (the few-shot benchmark
format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Sample:
    user_turns: tuple = ()  # chat: the user's messages, in order
    text: Optional[str] = None  # plain text: a prompt with no chat template
    source: str = ""  # the source's name (logs count samples per source)

    def __post_init__(self):
        assert (self.text is None) != (not self.user_turns), "a sample is chat or text, not both"

    @property
    def is_chat(self) -> bool:
        return self.text is None


class Source:
    """A named set of prompts, split once into a training part and a held-out part that no
    draft trains on (the benchmarks' prompts)."""

    name = ""

    def train(self) -> list:
        """Every training sample, in a fixed order (the mixture shuffles)."""
        raise NotImplementedError

    def heldout(self) -> list:
        """Samples no draft trains on."""
        raise NotImplementedError

    def check(self) -> None:
        """Raises, naming what is missing, where the data cannot be read (checked before a
        draft's training loads its target: a missing package failed only after the engine
        held its GPU memory)."""


USER_ROLES = ("human", "user")
KNOWN_ROLES = USER_ROLES + ("gpt", "assistant", "chatgpt", "bing", "bard", "model", "system")


def user_turns(row) -> tuple:
    """The user's messages of a ShareGPT row (`conversations`: from / value) or an OpenAI row
    (`messages`: role / content); () when the row is not a chat or has no user text."""
    if not isinstance(row, dict):
        return ()
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list):
        return ()
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return ()
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role not in KNOWN_ROLES or not isinstance(text, str):
            return ()
        if role in USER_ROLES and text.strip():
            out.append(text)
    return tuple(out)


def split_chats(convs: list, num_heldout: int) -> tuple:
    """(training, held-out) user-turn tuples of `convs`: the held-out part is the last
    `num_heldout` conversations, and training keeps each first turn once and none that a
    held-out conversation opens with. Chat dumps repeat prompts ("continue", "hi", one question
    pasted many times); the target answers a repeated prompt with the same greedy tokens, so a
    repeat on both sides would measure memory, not drafting, and repeats within training only
    weigh one answer many times."""
    cut = len(convs) - num_heldout
    heldout = convs[cut:]
    seen = {turns[0].strip() for turns in heldout}
    train = []
    for turns in convs[:cut]:
        first = turns[0].strip()
        if first not in seen:
            seen.add(first)
            train.append(turns)
    return train, heldout
