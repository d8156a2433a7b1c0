"""drafts.offline against the engine on CPU (fp32): for a trained draft of every kind, the
simulated chains verify exactly as often as the engine does, request by request, at two chain
lengths, with the same accepted-drafts histogram but for the last verify; and the walk itself on
hand-made hit tables."""

import pytest
import torch

from drafts.offline import ChainWalk, draft_hits, load_draft_model
from drafts.train import FEATURES, _feature_layers, train_draft
from drafts.train_data import Sequences, extract_features
from test_train import GREEDY, _engine, one_thread, tiny  # noqa: F401 (fixtures)

CPU = torch.device("cpu")


def _walk(rows: list, prompt_len: int, steps: int) -> ChainWalk:
    w = ChainWalk(steps)
    w.add(torch.tensor(rows, dtype=torch.bool), prompt_len)
    return w


def test_walk_counts_leading_hits_and_the_bonus_token():
    # Tokens 0..7, prompt of 2: the prefill gives token 2; roots from 2 on.
    every = [[True] * 8, [True] * 8]
    w = _walk(every, 2, 2)  # every draft hits: each verify emits 3 (2 drafts + bonus)
    assert (w.verifies, w.tokens, w.histogram) == (2, 6, [0, 0, 2])  # roots 2, 5 -> done at 8
    none = [[False] * 8, [False] * 8]
    w = _walk(none, 2, 2)
    assert (w.verifies, w.histogram) == (5, [5, 0, 0]) and w.accept_length == 6 / 5
    # Step 1 hits token 3 (root 2), step 2 misses token 4: one draft, then root 4.
    rows = [[False, False, False, True, False, False, False, False],
            [False] * 8]
    w = _walk(rows, 2, 2)
    assert w.histogram == [3, 1, 0] and w.verifies == 4


def test_a_draft_never_counts_past_the_sequence_end():
    w = _walk([[True] * 5] * 4, 3, 4)  # one token left after the prefill's
    assert (w.verifies, w.histogram) == (1, [0, 1, 0, 0, 0])


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
def test_offline_chains_verify_as_often_as_the_engine(algorithm, tiny, tmp_path):
    target, engine, prompts, plain = tiny
    out = train_draft(algorithm, target, prompts, str(tmp_path / "draft"), engine=engine,
                      max_new_tokens=GREEDY["max_new_tokens"], max_steps=80, lr=3e-3,
                      minutes=10, draft_vocab_size=96, num_layers=1, ttt_steps=5,
                      show_progress=False)
    seqs = Sequences([p + o for p, o in zip(prompts, plain)], [len(p) for p in prompts])
    draft = load_draft_model(algorithm, out, engine.model, engine.model_config, CPU,
                             torch.float32)
    aux = tuple(getattr(getattr(draft, "spec", None), "aux_layer_ids", ()) or ())
    feats = extract_features(engine.model, seqs, _feature_layers(algorithm, aux),
                             FEATURES[algorithm] is not None, CPU, show_progress=False)
    hits = draft_hits(algorithm, draft, feats, list(range(len(prompts))), 5, CPU)
    accepted = 0
    for steps in (3, 5):
        spec = _engine(target, speculative_algorithm=algorithm, speculative_draft_model_path=out,
                       disable_adaptive_speculation=True, speculative_num_steps=steps)
        outs = spec.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain
        walked = run = exact = 0
        for o, h, p in zip(outs, hits, seqs.prompt_lens):
            w = ChainWalk(steps)
            w.add(h, p)
            meta = o["meta_info"]
            # The barely trained draft's logits can tie to fp32 rounding, and the walk reads
            # features of one forward over the whole sequence where the engine reads its KV
            # cache (sums in another order, which depends on the CPU): a draft may flip there
            # and move the request's later verifies (NEXTN's did, on one 2-core CPU).
            assert abs(w.verifies - meta["spec_verify_ct"]) <= 2, (algorithm, steps)
            walked, run = walked + w.verifies, run + meta["spec_verify_ct"]
            # The last verify may accept drafts past max_new_tokens, which the engine then cuts
            # (the sequence has no token there): at most that one verify moves in the histogram.
            diff = [a - b for a, b in zip(meta["spec_accept_histogram"], w.histogram)]
            exact += sorted(d for d in diff if d) in ([], [-1, 1])
            accepted += sum(w.histogram[1:])
        # Both emit the same tokens: the accept lengths agree as the verify counts do.
        assert abs(run / walked - 1) <= 0.1, (algorithm, steps, run, walked)
        assert exact >= len(prompts) - 2, (algorithm, steps, exact)
    assert accepted > 0  # the comparison covered accepted drafts, not only misses


def test_by_source_splits_the_sequences_and_keeps_every_verify():
    from drafts.offline import offline_accept, offline_accept_by_source

    gen = torch.Generator().manual_seed(3)
    hits = [torch.rand(7, n, generator=gen) < 0.7 for n in (30, 41, 25, 50)]
    lens = [5, 9, 4, 12]
    sources = ["chat", "math", "chat", "math"]
    by = offline_accept_by_source(hits, lens, sources, (3, 7))
    assert set(by) == {"chat", "math"}
    assert by["chat"] == offline_accept([hits[0], hits[2]], [5, 4], (3, 7))
    whole = offline_accept(hits, lens, (3, 7))
    for key in whole:
        assert sum(by[s][key]["verifies"] for s in by) == whole[key]["verifies"]
        assert sum(by[s][key]["tokens"] for s in by) == whole[key]["tokens"]
