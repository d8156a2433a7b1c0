"""A `.jsonl` file of chats, one per line: ShareGPT rows (`conversations`: from / value) or
OpenAI rows (`messages`: role / content); GSM8K-style rows (`question`) become zero-shot chats.
The last HELDOUT_FRAC of the usable rows is held out; training skips repeated first turns
(base.split_chats)."""

from __future__ import annotations

import json
import os

from drafts.data.base import Sample, Source, split_chats, user_turns
from drafts.data.gsm8k import zero_shot_message

HELDOUT_FRAC = 0.05


def read_jsonl(path: str, log=print) -> list:
    """User turns of every usable line; a line that is not JSON or not a chat is dropped and
    counted; a file with none is refused."""
    if not os.path.isfile(path):
        raise ValueError(f"data {path!r} does not exist")
    turns, dropped, lines = [], 0, 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            lines += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            t = user_turns(row)
            if not t and isinstance(row, dict) and isinstance(row.get("question"), str):
                t = (zero_shot_message(row["question"]),)
            if t:
                turns.append(t)
            else:
                dropped += 1
    if not lines:
        raise ValueError(f"data {path!r} is empty")
    if not turns:
        raise ValueError(f"data {path!r} has no usable row ({lines} lines; each needs "
                         f"'conversations', 'messages' or 'question')")
    log(f"[drafts.data] {path}: kept {len(turns)} conversations; dropped {dropped} lines")
    return turns


class JsonlChats(Source):
    def __init__(self, path: str):
        self.path, self.name = path, os.path.basename(path)
        self._rows = None

    def check(self) -> None:
        if not os.path.isfile(self.path):
            raise ValueError(f"data source {self.path!r}: no such file")

    def _all(self) -> list:
        if self._rows is None:
            self._rows = read_jsonl(self.path)
        return self._rows

    def _parts(self) -> tuple:
        n = len(self._all())
        return split_chats(self._all(), max(round(n * HELDOUT_FRAC), 1) if n > 1 else 0)

    def train(self) -> list:
        return [Sample(user_turns=t, source=self.name) for t in self._parts()[0]]

    def heldout(self) -> list:
        return [Sample(user_turns=t, source=self.name) for t in self._parts()[1]]
