"""TextStream on the default model's tokenizer: deltas that add up to the whole decoded text,
never a broken character, stop strings held back, and each step decoding a window of tokens,
not the whole output again."""

import pytest

from specpcg.core import Request, SamplingParams
from specpcg.streaming import REPLACEMENT, TextStream

TEXT = ("Héllo wörld! Ünïcödé: naïve café, 日本語のテキスト, emoji 😀🚀 and  double  spaces.\n"
        "  Indented line — with dashes… and a tail.")


@pytest.fixture(scope="module")
def tokenizer():
    from specpcg.models.loader import default_model_path
    from specpcg.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.decoded_ids = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


def _stream(tok, ids: list, stop=()) -> tuple:
    """Feeds `ids` one token per step; returns (deltas, the stream)."""
    req = Request(prompt_ids=[1], params=SamplingParams(max_new_tokens=len(ids), stop=tuple(stop)))
    stream, deltas = TextStream(tok, req), []
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        if i == len(ids) - 1:
            req.finish_reason = "length"
        deltas.append(stream.next_chunk()["delta"])
    return deltas, stream


def test_deltas_add_up_to_the_whole_text_and_never_break_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    deltas, _ = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in d for d in deltas)
    assert sum(1 for d in deltas if d) > len(ids) // 2  # text flows as it comes


def test_each_step_decodes_a_window_not_the_whole_output(tokenizer):
    ids = tokenizer.encode(TEXT * 4)
    counting = CountingTokenizer(tokenizer)
    _stream(counting, ids)
    # The whole output once at the end, plus a few tokens a step (decoding it all every step
    # would be len(ids)^2 / 2 tokens).
    assert counting.decoded_ids < 8 * len(ids)


def test_a_possible_stop_string_is_held_back(tokenizer):
    ids = tokenizer.encode("one two STOP three")
    req = Request(prompt_ids=[1], params=SamplingParams(max_new_tokens=99, stop=("STOP",)))
    stream = TextStream(tokenizer, req)
    shown = ""
    for t in ids:
        req.output_ids.append(t)
        shown += stream.next_chunk()["delta"]
        full = tokenizer.decode(req.output_ids)
        assert full.startswith(shown) and len(full) - len(shown) >= min(3, len(full))
