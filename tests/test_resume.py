"""drafts/resume.py's chunking: which runner each replay takes and what it feeds."""

from types import SimpleNamespace

import torch

import drafts.resume as resume


class _Runner(SimpleNamespace):
    runner_name, eager_reason = "draft_round_graph", None
    model_runner = SimpleNamespace(kv_cache=SimpleNamespace(req_pool=SimpleNamespace(
        pad_row=3, req_to_token=torch.zeros(4, 8, dtype=torch.int32))))

    def bucket(self, n):
        return n if n <= self.max_bs else None

    def load_on_device(self, bs, rows, path):
        self.__dict__.setdefault("loads", []).append(
            (bs, rows.tolist(), path.first_pos.tolist(), path.lens.tolist(), path.ids.shape))


class _Router:
    def __init__(self):
        self.counts = []

    def count(self, *a):
        self.counts.append(a)


def _resume(max_bs=4):
    return resume.ResumeCatchUp([_Runner(width=36, max_bs=max_bs),
                                 _Runner(width=8, max_bs=max_bs)])


def test_chunks_take_the_narrowest_width_that_fits_and_continue_where_they_stopped(monkeypatch):
    calls = []
    monkeypatch.setattr(resume, "_replay",
                        lambda rnd, kv, part, flat: calls.append((rnd.width, part, flat)))
    rr, router = _resume(), _Router()
    ids = [list(range(100, 140)), [7, 8, 9], []]
    flat = torch.zeros(50, 2)
    rr.run(None, router, [5, 6, 9], [10, 20, 30], ids, resume.HiddenRows(flat, [3, 45, 50]))
    # 40 rows need the wide runner twice (36, then 4 on the narrow one); the 3-row request
    # rides the first replay; the empty one never appears. Each piece's target rows start
    # where its request's start, moved on by what earlier replays took.
    assert [w for w, _, _ in calls] == [36, 8]
    assert all(f is flat for _, _, f in calls)
    first, second = calls[0][1], calls[1][1]
    assert first == [(5, 10, ids[0][:36], 3), (6, 20, [7, 8, 9], 45)]
    assert second == [(5, 46, ids[0][36:], 3 + 36)]
    assert len(router.counts) == 2


class _Buf(SimpleNamespace):
    pass


def test_a_replay_moves_each_pieces_target_rows_into_its_slots(monkeypatch):
    """_replay's one host copy: every piece's rows land at (its index * width + j) of the
    runner's hidden buffer, from its own rows of `flat`, and the ids and lengths load as
    given; nothing else in the buffer moves."""
    loaded = {}
    rnd = SimpleNamespace(width=4, bucket=lambda n: 4,
                          buf=_Buf(target_hidden=torch.full((16, 2), -1.0)),
                          load_on_device=lambda bs, rows, path: loaded.update(
                              bs=bs, rows=rows.tolist(), ids=path.ids.tolist(),
                              lens=path.lens.tolist(), first=path.first_pos.tolist()),
                          catch_up=lambda bs, ends, lens: loaded.update(ends=ends))
    kv = SimpleNamespace(extend_many=lambda rows, counts: loaded.update(extended=counts),
                         req_pool=SimpleNamespace(req_to_token=torch.zeros(1)))
    flat = torch.arange(20.0).view(10, 2)
    resume._replay(rnd, kv, [(7, 30, [1, 2, 3], 5), (8, 40, [9], 0)], flat)
    assert loaded["rows"] == [7, 8] and loaded["first"] == [30, 40] and loaded["lens"] == [3, 1]
    assert loaded["ids"] == [[1, 2, 3, 0], [9, 0, 0, 0]] and loaded["extended"] == [3, 1]
    assert loaded["ends"] == [33, 41, 1, 1]
    want = torch.full((16, 2), -1.0)
    want[0:3] = flat[5:8]
    want[4] = flat[0]
    assert torch.equal(rnd.buf.target_hidden, want)


def test_fits_caps_replays_and_batch_size():
    rr = _resume(max_bs=2)
    assert rr.fits([4 * 36, 1])
    assert not rr.fits([4 * 36 + 1])  # a fifth replay: one eager forward instead
    assert not rr.fits([1, 1, 1])  # no captured batch of 3
    assert not rr.fits([])


def test_the_prompt_runner_is_built_always_the_look_runners_where_speculation_pauses(
        monkeypatch):
    """Every speculating engine catches its draft up on new prompts: the prompt runner is
    built pinned or not, over batches of up to PROMPT_MAX_BS requests. Adaptive speculation,
    or a batch cap with it pinned, puts plain steps between speculative ones: only they add
    the two look widths."""
    import drafts.wiring as wiring
    from specpcg.config import EngineConfig

    built = []
    monkeypatch.setattr(wiring, "build_round_runner",
                        lambda *a, width, max_bs=0, **k: built.append((width, max_bs))
                        or _Runner(width=width, max_bs=max_bs or 64))
    prompt = (resume.PROMPT_WIDTH, resume.PROMPT_MAX_BS)
    for kw, looks in (({}, True), ({"disable_adaptive_speculation": True}, False),
                      ({"disable_adaptive_speculation": True,
                        "speculative_disable_by_batch_size": 16}, True)):
        built.clear()
        got = resume.ResumeCatchUp.build(None, None, EngineConfig(**kw), round_width=4)
        assert built == ([(8, 0), (36, 0)] if looks else []) + [prompt], kw
        assert [r.width for r in got.runners] == [w for w, _ in built], kw
        # each loaded once at startup: one request of the pad row, one token at position 0
        assert [r.loads for r in got.runners] == [
            [(1, [3], [0], [1], (1, r.width))] for r in got.runners], kw


def test_every_packed_piece_starts_16_byte_aligned_whatever_the_batch():
    """Triton specializes a pointer on 16-byte alignment: an odd batch's first positions and
    roots at an 8-byte offset compiled a second variant of the loading kernel mid-serving."""
    for n in range(1, 6):
        part = [(10 + i, 20 + i, [1, 2][:1 + i % 2], 5 * i) for i in range(n)]
        rows, path, hidden_at = resume._pack(part, 4, "cpu", True)
        pieces = (rows, path.first_pos, path.lens, path.roots, path.ids, hidden_at)
        assert all(t.data_ptr() % 16 == 0 for t in pieces), n
        assert rows.tolist() == [10 + i for i in range(n)]
        assert path.first_pos.tolist() == [20 + i for i in range(n)]
        assert path.lens.tolist() == [1 + i % 2 for i in range(n)]
        assert path.ids[:, :1].flatten().tolist() == [1] * n
        moved = sum(1 + i % 2 for i in range(n))
        assert hidden_at.shape == (2, moved)


def test_a_catch_up_takes_only_runners_captured_for_its_batch(monkeypatch):
    """The prompt runner serves up to its own batch size: a long catch-up of a few requests
    takes it (fewer replays), one of more requests the look runners, and one too long for
    those goes eager (fits is False)."""
    calls = []
    monkeypatch.setattr(resume, "_replay",
                        lambda rnd, kv, part, flat: calls.append((rnd.width, len(part))))
    rr = resume.ResumeCatchUp([_Runner(width=36, max_bs=8), _Runner(width=8, max_bs=8),
                               _Runner(width=256, max_bs=2)])
    assert rr.fits([300, 5]) and not rr.fits([300, 5, 5])
    assert rr.fits([100, 5, 5]) and not rr.fits([145, 5, 5])
    rr.run(None, _Router(), [1, 2], [0, 0], [list(range(300)), [1] * 5])
    assert calls == [(256, 2), (256, 1)]  # 256 of 300 with the short one, then the last 44
    calls.clear()
    rr.run(None, _Router(), [1, 2, 3], [0, 0, 0], [list(range(100)), [1] * 5, [2] * 5])
    # 36 for all three, then the long one's last 64 alone: the prompt runner takes it whole.
    assert calls == [(36, 3), (256, 1)]
