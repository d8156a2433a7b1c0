"""drafts/resume.py's chunking: which runner each replay takes and what it feeds."""

from types import SimpleNamespace

import drafts.resume as resume


class _Runner(SimpleNamespace):
    runner_name, eager_reason = "draft_round_graph", None

    def bucket(self, n):
        return n if n <= self.max_bs else None


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
    monkeypatch.setattr(resume, "_replay", lambda rnd, kv, part: calls.append((rnd.width, part)))
    rr, router = _resume(), _Router()
    ids = [list(range(100, 140)), [7, 8, 9], []]
    hidden = [list(range(40)), ["a", "b", "c"], []]
    rr.run(None, router, [5, 6, 9], [10, 20, 30], ids, hidden)
    # 40 rows need the wide runner twice (36, then 4 on the narrow one); the 3-row request
    # rides the first replay; the empty one never appears.
    assert [w for w, _ in calls] == [36, 8]
    first, second = calls[0][1], calls[1][1]
    assert [(row, pos, len(x)) for row, pos, x, _ in first] == [(5, 10, 36), (6, 20, 3)]
    assert first[0][2] == ids[0][:36] and first[0][3] == hidden[0][:36]
    assert second == [(5, 46, ids[0][36:], hidden[0][36:])]
    assert len(router.counts) == 2


def test_fits_caps_replays_and_batch_size():
    rr = _resume(max_bs=2)
    assert rr.fits([4 * 36, 1])
    assert not rr.fits([4 * 36 + 1])  # a fifth replay: one eager forward instead
    assert not rr.fits([1, 1, 1])  # no captured batch of 3
    assert not rr.fits([])
