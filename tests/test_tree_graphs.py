"""Tree graphs on CPU: the decode runner's tree shapes, padding and routing, with an eager body
standing in for the CUDA graph replay (capture needs a GPU; `test_cuda_graphs.py` replays the
real graphs). A tree engine's verifies and its head's tree steps must reach the runner, padded
to a bucket, and keep every greedy token of plain decoding."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

import drafts.wiring as wiring_module
import specpcg.engine as engine_module
from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode
from specpcg.graphs.buckets import pick_bucket
from specpcg.graphs.decode_runner import DecodeGraphRunner
from specpcg.graphs.draft_runner import DraftGraphRunner
from specpcg.graphs.policy import GraphDecision
from specpcg.graphs.setup import GraphSet
from specpcg.router import Refusal
from tests.eagle_world import SETTINGS, _engine, plain, world  # noqa: F401 (fixtures)

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the Triton backend on CPU needs TRITON_INTERPRET=1")


class EagerReplay(DecodeGraphRunner):
    """A decode runner whose 'replay' runs the padded batch eagerly: everything but the capture."""

    def capture(self) -> None:
        self.replays = Counter()

    def forward(self, batch: ForwardBatch):
        bs = pick_bucket(self.buckets, batch.batch_size)
        padded = self._padded_batch(batch, bs)
        self.replays[(batch.forward_mode.name, self._keys(batch), bs)] += 1
        hidden, aux = self.model_runner.forward_body(padded)
        logits = self.model_runner.model.compute_logits(hidden)
        return self.model_runner.postprocess(hidden, list(aux), batch, logits)


def _eager_replay_graphs(cfg, runner, context_len, hidden_mode=None, aux_layers=(),
                         num_verify_tokens=0, verify_tree=False, draft_tree=(), draft=False):
    decode = EagerReplay(runner, [1, 2, 4, 8], hidden_mode or CaptureHiddenMode.NULL,
                         aux_layers, None, num_verify_tokens, verify_tree, False, draft_tree)
    decode.capture()
    return GraphSet(None, decode, GraphDecision(False, "eager replay test"),
                    GraphDecision(True, "eager replay test"))


@needs_interpreter
@pytest.mark.parametrize("algo", ["EAGLE3", "NGRAM"])
def test_tree_verify_and_tree_steps_replay_padded(world, plain, monkeypatch, algo):
    monkeypatch.setattr(engine_module, "build_graphs", _eager_replay_graphs)
    monkeypatch.setattr(wiring_module, "build_graphs", _eager_replay_graphs)
    # The round's catch-up body runs uncaptured, padded to its bucket, as its graph would.
    monkeypatch.setattr(DraftGraphRunner, "capture", lambda self: None)
    head = world.heads[algo] if algo != "NGRAM" else None
    # The synchronous loop's graphs (overlapped tree steps: test_spec_overlap, test_ngram_overlap).
    engine = _engine(world.noisy, algo, head, **{**SETTINGS["tree"], "attention_backend": "triton"},
                     disable_overlap_schedule=True)
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    spec = engine.spec
    target = engine.graphs.decode.replays
    verifies = {k: n for k, n in target.items() if k[0] == "TARGET_VERIFY"}
    assert verifies and {k[1] for k in verifies} == {spec.num_draft_tokens}
    assert any(bs > 1 for _, _, bs in verifies)  # batched verifies, padded to their bucket
    stats = {(s["mode"], s["runner"]) for s in engine.router.forward_stats()}
    assert ("TARGET_VERIFY", "eager") not in stats, stats
    if algo == "EAGLE3":  # the catch-up and every tree step run in the head's round
        draft = {(s["mode"], s["runner"]): s["count"] for s in engine.draft.router.forward_stats()}
        rounds = engine.draft.round
        assert set(rounds.extra) == {"tree"} and rounds.width == spec.num_draft_tokens
        assert draft.get(("DRAFT_EXTEND", "draft_round_graph"), 0) > 0, draft
        assert not [k for k in engine.draft.graphs.decode.replays if k[0] == "DRAFT_EXTEND"]


@needs_interpreter
def test_a_tree_shape_not_captured_is_refused(world):
    engine = _engine(world.noisy)
    runner = EagerReplay(engine.runner, [1, 2], CaptureHiddenMode.NULL, (), None, 4, True,
                         False, (2, 3))

    def batch(mode, width, keys=None):
        n = 2 * width
        b = ForwardBatch(forward_mode=mode, input_ids=torch.zeros(n, dtype=torch.long),
                         positions=torch.zeros(n, dtype=torch.long),
                         out_cache_loc=torch.zeros(n, dtype=torch.long),
                         req_pool_indices=torch.zeros(2, dtype=torch.long),
                         seq_lens=torch.full((2,), 9), extend_seq_lens=torch.full((2,), width),
                         seq_lens_cpu=[9, 9], extend_seq_lens_cpu=[width, width])
        if keys:
            b.tree_mask = torch.ones(2, width, keys, dtype=torch.bool)
        return b

    assert runner.refusal(batch(ForwardMode.DRAFT_EXTEND, 2, 2)) is None
    assert runner.refusal(batch(ForwardMode.DRAFT_EXTEND, 2, 4)) is None
    assert runner.refusal(batch(ForwardMode.DRAFT_EXTEND, 2, 6)) == Refusal.TREE_MASK
    assert runner.refusal(batch(ForwardMode.DRAFT_EXTEND, 2)) == Refusal.CHAIN_NOT_CAPTURED
    assert runner.refusal(batch(ForwardMode.DRAFT_EXTEND, 3, 3)) == Refusal.TOKENS_PER_REQUEST
    assert runner.refusal(batch(ForwardMode.TARGET_VERIFY, 4, 4)) is None
    assert runner.refusal(batch(ForwardMode.TARGET_VERIFY, 4, 2)) == Refusal.TREE_MASK
    assert runner.tree_keys == {ForwardMode.TARGET_VERIFY: (4,), ForwardMode.DRAFT_EXTEND: (2, 4)}


@pytest.mark.cuda
@pytest.mark.parametrize("algo", ["EAGLE3", "EAGLE"])
def test_cuda_tree_graphs_keep_every_token(world, algo):
    """The real graphs (fp32, TF32 off): a head's tree rounds and the target's tree verifies
    replay CUDA graphs, and greedy tokens equal plain decoding's on the same GPU."""
    from specpcg import Engine

    torch.backends.cuda.matmul.allow_tf32 = False
    common = dict(model_path=world.noisy, device="cuda", dtype="float32",
                  skip_tokenizer_init=True, show_progress=False, max_total_tokens=4096,
                  attention_backend="triton")
    plain_engine = Engine(**common)
    want = [o["output_ids"] for o in plain_engine.generate(input_ids=world.prompts,
                                                          sampling_params=world.params)]
    plain_engine.shutdown()
    tree = {k: v for k, v in SETTINGS["tree"].items() if k != "attention_backend"}
    engine = Engine(**common, speculative_algorithm=algo,
                    speculative_draft_model_path=world.heads[algo],
                    disable_adaptive_speculation=True, **tree)
    got = [o["output_ids"] for o in engine.generate(input_ids=world.prompts,
                                                   sampling_params=world.params)]
    assert got == want
    target = {(s["mode"], s["runner"]) for s in engine.router.forward_stats()}
    # Verifies on the decode graphs, or inside the overlapped step's graph (a head's trees
    # overlap as chains do); never eagerly.
    assert target & {("TARGET_VERIFY", "decode_graph"), ("TARGET_VERIFY", "spec_step_graph")}
    assert ("TARGET_VERIFY", "eager") not in target, target
    draft = {(s["mode"], s["runner"]): s["count"] for s in engine.draft.router.forward_stats()}
    # Every tree step and the catch-up on a verify replay the head's round graphs, or the
    # overlapped step's, which holds the same bodies.
    assert sum(draft.get(("DRAFT_EXTEND", r), 0)
               for r in ("draft_round_graph", "spec_step_graph")) > 0, draft
    assert ("DRAFT_EXTEND", "decode_graph") not in draft, draft
    engine.shutdown()
