"""drafts.data on CPU: the ShareGPT stream reader on truncated and broken files, .jsonl chats,
the mixture parser and draws, and bad data refused by name."""

import io
import json

import pytest

from drafts.data import create_source, heldout_samples, training_samples
from drafts.data.base import user_turns
from drafts.data.jsonl import read_jsonl
from drafts.data.mixture import draw, parse_mixture, split_counts
from drafts.data.sharegpt import ShareGpt, StreamStats, iter_json_array, read_conversations


def _conv(i: int, turns: int = 2) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"question {i}.{t}"},
                 {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": str(i), "conversations": msgs}


def _array(records: list) -> str:
    return "[\n" + ",\n".join(json.dumps(r, indent=2) for r in records) + "\n]"


def test_a_cut_off_array_keeps_every_complete_record_and_counts_the_rest():
    text = _array([_conv(i) for i in range(50)])
    cut = text[:text.index('"id": "49"') + 20]  # inside record 49
    stats = StreamStats()
    records = list(iter_json_array(io.StringIO(cut), stats))
    assert [r["id"] for r in records] == [str(i) for i in range(49)]
    assert (stats.records, stats.truncated) == (49, 1)
    whole = StreamStats()
    assert len(list(iter_json_array(io.StringIO(text), whole))) == 50 and whole.truncated == 0


def test_records_larger_than_a_read_chunk_are_read_whole(monkeypatch):
    import drafts.data.sharegpt as sg

    monkeypatch.setattr(sg, "CHUNK_CHARS", 7)  # every record spans many reads
    stats = StreamStats()
    records = list(iter_json_array(io.StringIO(_array([_conv(i, 3) for i in range(5)])), stats))
    assert [user_turns(r) for r in records][4] == ("question 4.0", "question 4.1", "question 4.2")


def test_the_reader_reports_drops_and_refuses_a_file_with_nothing_complete(tmp_path):
    good = [_conv(0), {"id": "x", "conversations": []}, _conv(2, 1)]
    path = tmp_path / "chats.json"
    path.write_text(_array(good)[:-2] + ', {"id": "cut", "conv')
    said = []
    convs = read_conversations(str(path), log=said.append)
    assert convs == [("question 0.0", "question 0.1"), ("question 2.0",)]
    assert "kept 2 conversations; dropped 1 truncated and 1 without a user turn" in said[0]
    path.write_text('[{"id": "cut", "conversations": [{"from": "human", "val')
    with pytest.raises(ValueError, match="holds no complete conversation"):
        read_conversations(str(path), log=said.append)
    path.write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="not a JSON array"):
        read_conversations(str(path), log=said.append)
    path.write_text("")
    with pytest.raises(ValueError, match="not a JSON array"):
        read_conversations(str(path), log=said.append)


def test_sharegpt_holds_out_its_last_records(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(_array([_conv(i, 1) for i in range(30)]))
    src = ShareGpt(str(path), heldout_records=5)
    train, held = src.train(), src.heldout()
    assert len(train) == 25 and len(held) == 5
    assert held[0].user_turns == ("question 25.0",)
    assert not {s.user_turns for s in train} & {s.user_turns for s in held}


def test_training_keeps_a_repeated_prompt_once_and_none_that_opens_a_held_out_chat(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": v}]}
             for v in ["continue", "q1", "continue ", "q2", "q1", "q9", "q9", "continue"]]
    path = tmp_path / "chats.json"
    path.write_text(_array(convs))
    src = ShareGpt(str(path), heldout_records=2)
    # Held out: the last two ("q9", "continue"); training: each other opening once, and
    # neither "continue" (whatever its spaces) nor "q9".
    assert [s.user_turns[0] for s in src.heldout()] == ["q9", "continue"]
    assert [s.user_turns[0] for s in src.train()] == ["q1", "q2"]


def test_user_turns_reads_both_row_kinds_and_rejects_others():
    openai = {"messages": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "bye"}]}
    assert user_turns(openai) == ("hi", "bye")
    assert user_turns(_conv(3, 1)) == ("question 3.0",)
    assert user_turns({"messages": [{"role": "wizard", "content": "x"}]}) == ()
    assert user_turns({"conversations": "text"}) == () and user_turns([1, 2]) == ()


def test_jsonl_chats_keep_good_lines_and_refuse_empty_or_unusable_files(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([json.dumps(_conv(0, 1)), "{broken",
                               json.dumps({"question": "2 + 2?", "answer": "#### 4"}),
                               json.dumps({"text": "no chat"})]) + "\n")
    said = []
    rows = read_jsonl(str(path), log=said.append)
    assert rows[0] == ("question 0.0",) and rows[1][0].startswith("2 + 2?\nLet's think")
    assert "kept 2 conversations; dropped 2 lines" in said[0]
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        read_jsonl(str(path))
    path.write_text(json.dumps({"text": "no chat"}) + "\n")
    with pytest.raises(ValueError, match="has no usable row"):
        read_jsonl(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("spec,want", [
    ("sharegpt", [("sharegpt", 1.0)]),
    ("sharegpt:0.8,gsm8k:0.2", [("sharegpt", 0.8), ("gsm8k", 0.2)]),
    ("a.jsonl:3, gsm8k:1", [("a.jsonl", 0.75), ("gsm8k", 0.25)]),
    ("C:/data/x.jsonl", [("C:/data/x.jsonl", 1.0)]),
])
def test_mixtures_parse_to_normalised_weights(spec, want):
    got = parse_mixture(spec)
    assert [n for n, _ in got] == [n for n, _ in want]
    assert [w for _, w in got] == pytest.approx([w for _, w in want])


@pytest.mark.parametrize("spec,match", [
    ("", "must name a source"), ("sharegpt:0", "weight > 0"), ("sharegpt:-1", "weight > 0"),
    (":0.5", "needs a source name"), ("gsm8k,gsm8k", "names a source twice"),
])
def test_bad_mixtures_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_mixture(spec)


def test_unknown_sources_are_refused_by_name_before_any_read():
    with pytest.raises(ValueError, match=r"data source 'wikipedia' is unknown"):
        training_samples("gsm8k:0.5,wikipedia:0.5", 10)
    with pytest.raises(ValueError, match=r"data source 'notes.txt' is unknown"):
        create_source("notes.txt")


def test_counts_follow_weights_and_draws_are_seeded():
    assert split_counts(10, [0.7, 0.2, 0.1]) == [7, 2, 1]
    assert split_counts(7, [0.5, 0.5]) in ([4, 3], [3, 4]) and sum(split_counts(7, [0.5] * 2)) == 7
    pools = [list(range(100)), list(range(100, 103))]
    a = draw(pools, [5, 10], seed=1)
    assert a == draw(pools, [5, 10], seed=1) and a != draw(pools, [5, 10], seed=2)
    assert len(a) == 8 and {100, 101, 102} <= set(a)  # a short pool gives all it has


def test_gsm8k_train_and_heldout_never_share_a_question():
    train = training_samples("gsm8k:0.5,gsm8k-fewshot:0.5", 400, seed=0)
    held = heldout_samples("gsm8k", 200, seed=0)
    assert {s.source for s in train} == {"gsm8k", "gsm8k-fewshot"}
    chat_train = {s.user_turns for s in train if s.is_chat}
    assert not chat_train & {s.user_turns for s in held}
    few = next(s for s in train if not s.is_chat)
    assert few.text.count("Question:") == 6 and few.text.endswith("\nAnswer:")


class _EchoEngine:
    """Answers every prompt with [its length, 7, 7] at once; its chat template joins turns."""

    class tokenizer:
        @staticmethod
        def encode(text):
            return [ord(c) for c in text]

        @staticmethod
        def apply_chat_template(messages):
            return [ord(c) for c in "|".join(f"{m['role']}:{m['content']}" for m in messages)]

        @classmethod
        def encode_many(cls, texts):
            return [cls.encode(t) for t in texts]

        @classmethod
        def apply_chat_template_many(cls, conversations):
            return [cls.apply_chat_template(m) for m in conversations]

    def __init__(self):
        self.pending, self.rid = [], 0

    def submit(self, input_ids, sampling_params):
        self.rid += 1
        self.pending.append((self.rid, input_ids))
        return self.rid

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        done, self.pending = self.pending, []
        return [{"meta_info": {"id": rid}, "output_ids": [len(ids), 7, 7], "text": f"a{len(ids)}"}
                for rid, ids in done]


def test_self_distill_trains_on_every_turn_and_ends_a_chat_at_a_long_turn():
    from drafts.data.base import Sample
    from drafts.distill import self_distill

    chat = Sample(user_turns=("hi", "more", "x" * 80), source="chat")
    text = Sample(text="plain", source="text")
    seqs = self_distill(_EchoEngine(), [chat, text], max_new_tokens=3, max_turns=3,
                        max_prompt_tokens=60)
    turn1 = [ord(c) for c in "user:hi"]
    turn2 = [ord(c) for c in f"user:hi|assistant:a{len(turn1)}|user:more"]
    # Both chat turns that fit are sequences of their own, each its prompt + its answer; the
    # third turn does not fit max_prompt_tokens and ends the chat.
    assert seqs.token_ids == [turn1 + [len(turn1), 7, 7], turn2 + [len(turn2), 7, 7],
                              [ord(c) for c in "plain"] + [5, 7, 7]]
    assert seqs.prompt_lens == [len(turn1), len(turn2), 5]
    assert seqs.sources == ["chat", "chat", "text"]
    assert seqs.groups == [0, 0, 1]  # a chat's turns are one group
    assert seqs.turns == [0, 1, 0]


def test_self_distill_groups_repeated_openings_together():
    from drafts.data.base import Sample
    from drafts.distill import self_distill

    samples = [Sample(user_turns=("hi",)), Sample(user_turns=("yo",)),
               Sample(user_turns=(" hi", "more"))]
    seqs = self_distill(_EchoEngine(), samples, max_new_tokens=3, max_turns=2)
    assert len(seqs.token_ids) == 4
    assert seqs.groups == [0, 1, 0, 0]


class _OneAtATimeEngine(_EchoEngine):
    """Answers the oldest pending prompt only, one per step; records what was pending when
    each prompt arrived."""

    def __init__(self):
        super().__init__()
        self.pending_at_submit = []

    def submit(self, input_ids, sampling_params):
        self.pending_at_submit.append(len(self.pending))
        return super().submit(input_ids, sampling_params)

    def step(self):
        (rid, ids), self.pending = self.pending[0], self.pending[1:]
        return [{"meta_info": {"id": rid}, "output_ids": [len(ids), 7, 7], "text": f"a{len(ids)}"}]


def test_a_chat_asks_its_next_turn_without_waiting_for_other_chats():
    from drafts.data.base import Sample
    from drafts.distill import self_distill

    chats = [Sample(user_turns=(f"q{i}", "more"), source="chat") for i in range(3)]
    engine = _OneAtATimeEngine()
    seqs = self_distill(engine, chats, max_new_tokens=3, max_turns=2)
    # Chat 0's second turn arrives while chats 1 and 2 still wait for their first answers.
    assert engine.pending_at_submit == [0, 1, 2, 2, 2, 2]
    assert len(seqs.token_ids) == 6
    assert seqs.sources == ["chat"] * 6
    # Sequences stay grouped by chat, turn after turn, whatever order the answers came in.
    firsts = [ord(c) for c in "user:q1"]
    assert seqs.token_ids[2] == firsts + [len(firsts), 7, 7]
