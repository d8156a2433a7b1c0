"""EAGLE, EAGLE3 and NEXTN draft heads on CPU (fp32): lossless chain and tree drafting, preemption
and sampling, the hidden states each head is handed, and the default model on GSM8K prompts.
The synthetic target and hand-built heads are described in tests/eagle_world.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F

import specpcg.engine as engine_module
import specpcg.models.llama as llama_module
from drafts.head_checkpoint import random_head, save_head
from specpcg import Engine
from specpcg.core import ForwardMode
from specpcg.forward_context import get_forward_context

from tests.eagle_world import (  # noqa: F401 (fixtures)
    ALGOS, SETTINGS, world, plain, _engine, _check_spec_meta, _check_no_leak,
    _exact_outputs_all_accepted, _synthetic_head)


# ---- 1. greedy lossless ------------------------------------------------------------------------

HAS_CPU_TRITON = (importlib.util.find_spec("triton") is not None
                  and os.environ.get("TRITON_INTERPRET") == "1")
# Trees on the Triton backend: split-K decode queries under the tree mask (interpreter on CPU).
LOSSLESS = {**SETTINGS, "tree_triton": {**SETTINGS["tree"], "attention_backend": "triton"}}


@pytest.mark.parametrize("setting", LOSSLESS)
@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_is_lossless_single_and_batched(world, plain, algo, setting):
    if setting == "tree_triton" and not HAS_CPU_TRITON:
        pytest.skip("needs triton and the interpreter (TRITON_INTERPRET=1)")
    engine = _engine(world.noisy, algo, world.heads[algo], **LOSSLESS[setting])
    single = engine.generate(input_ids=world.prompts[0], sampling_params=world.params[0])
    assert single["output_ids"] == plain.single
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == plain.reasons
    n = engine.spec.num_draft_tokens
    assert n == (4 if setting == "chain" else 6)
    metas = [single["meta_info"]] + [o["meta_info"] for o in outs]
    for meta in metas:
        _check_spec_meta(meta, n)
    state = engine.get_server_info()["internal_states"][0]
    assert state["spec_verify_ct"] == sum(m["spec_verify_ct"] for m in metas)
    assert sum(state["spec_accept_histogram"].values()) == state["spec_verify_ct"]
    # The noisy target makes acceptance partial: full, partial and zero acceptances all occur.
    accepted = {m for meta in metas for m, c in enumerate(meta["spec_accept_histogram"]) if c}
    assert 0 in accepted and len(accepted) >= 3, accepted
    assert state["avg_spec_accept_length"] > 1.2
    _check_no_leak(engine)
    if setting == "tree_triton":  # no graphs on CPU: tree verifies run eagerly
        stats = {(s["mode"], s["runner"], s["reason"]) for s in engine.router.forward_stats()}
        off = engine.graphs.decode_decision.reason
        # Every step is an overlapped one (its body eagerly, where a GPU replays it), the first
        # after a prefill too since the draft catches up first (catch_up_to_paths); a
        # synchronous verify would run eagerly by the reason graphs are off.
        verifies = {(runner, reason) for mode, runner, reason in stats if mode == "TARGET_VERIFY"}
        assert verifies and verifies <= {("spec_step_eager", None), ("eager", off)}, stats
        assert engine.graphs.decode is None and engine._graph_needs()["verify_tree"]
        draft = {(s["mode"], s["runner"]) for s in engine.draft.router.forward_stats()}
        # The catch-up on a verify's accepted path runs in the body of the overlapped step, as
        # its graph would; a prompt's first catch-up in the prompt runner's body
        # (drafts/resume.py): no draft forward runs eagerly.
        assert ("DRAFT_EXTEND", "spec_step_eager") in draft, draft
        assert ("DRAFT_EXTEND", "draft_round_eager") in draft, draft
        assert all(runner != "eager" for _, runner in draft), draft
    if setting == "chain":  # greedy chains run the round's bodies (eagerly here, no graphs)
        stats = {(s["mode"], s["runner"]): s["count"] for s in engine.draft.router.forward_stats()}
        assert stats.get(("DRAFT_EXTEND", "draft_round_eager"), 0) > 0, stats
        assert stats.get(("DECODE", "draft_round_eager"), 0) > 0, stats
        assert ("DECODE", "eager") not in stats, stats


@pytest.mark.parametrize("algo", ALGOS)
def test_round_padded_to_a_bucket_is_lossless(world, plain, algo):
    """The round's bodies on a batch padded up to a larger bucket (as a captured graph runs
    them): padding requests on the pad row and sink slots change no real request's output."""
    from specpcg.graphs.draft_runner import DraftGraphRunner

    engine = _engine(world.noisy, algo, world.heads[algo])
    draft = engine.draft
    width = engine.model_config.hidden_size * max(1, len(draft.aux_layers))
    draft.round = DraftGraphRunner(draft.runner, [len(world.prompts) + 3], engine.spec.num_steps,
                                   width)  # no eager_reason: bucket padding, bodies uncaptured
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    stats = {(s["mode"], s["runner"]): s["count"] for s in draft.router.forward_stats()}
    assert stats.get(("DRAFT_EXTEND", "draft_round_graph"), 0) > 0, stats
    assert stats.get(("DECODE", "draft_round_graph"), 0) > 0, stats
    _check_no_leak(engine)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("algo", ALGOS)
def test_preempted_and_sampled_requests(world, plain, algo, setting):
    """A KV cache too small for the batch preempts requests (the draft drops their state and
    re-absorbs it on re-prefill) and prompts are prefilled in chunks of 16 tokens (the draft
    absorbs each chunk's hidden states): greedy tokens do not change; sampled requests in the
    same batch finish at their lengths and repeat under the same seed; nothing leaks."""
    engine = _engine(world.noisy, algo, world.heads[algo], max_total_tokens=150,
                     chunked_prefill_size=16, **SETTINGS[setting])
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert engine.get_server_info()["num_preemptions"] > 0
    assert [o["output_ids"] for o in outs] == plain.batch
    _check_no_leak(engine)
    sampled = [{**p, "temperature": 0.8, "seed": i, "ignore_eos": True}
               for i, p in enumerate(world.params)]
    mixed = [sampled[i] if i % 2 else world.params[i] for i in range(len(sampled))]
    first = engine.generate(input_ids=world.prompts, sampling_params=mixed)
    again = engine.generate(input_ids=world.prompts, sampling_params=mixed)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    for i, out in enumerate(first):
        if i % 2:
            assert len(out["output_ids"]) == mixed[i]["max_new_tokens"]
        else:
            assert out["output_ids"] == plain.batch[i]
    _check_no_leak(engine)


def test_output_logprobs_with_a_head_draft(world):
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = _engine(world.noisy).generate(input_ids=world.prompts[4], sampling_params=params,
                                         return_logprob=True)["meta_info"]
    got = _engine(world.noisy, "EAGLE", world.heads["EAGLE"]).generate(
        input_ids=world.prompts[4], sampling_params=params, return_logprob=True)["meta_info"]
    assert len(got["output_token_logprobs"]) == got["completion_tokens"] == 8
    got_lps, want_lps = got["output_token_logprobs"], want["output_token_logprobs"]
    assert [t for _, t in got_lps] == [t for _, t in want_lps]
    assert [lp for lp, _ in got_lps] == pytest.approx([lp for lp, _ in want_lps], abs=1e-4)


# ---- 2. a head that provably predicts well, and what the head is handed ----------------------

@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("algo", ALGOS)
def test_synthetic_head_accepts_every_draft_on_the_exact_target(world, algo, setting):
    """Right only when handed the target state of the right position: every draft accepted."""
    engine = _engine(world.exact, algo, world.heads[algo], **SETTINGS[setting])
    _exact_outputs_all_accepted(world, engine)
    steps = engine.spec.num_steps
    state = engine.get_server_info()["internal_states"][0]
    assert state["avg_spec_accept_length"] == steps + 1
    _check_no_leak(engine)


@pytest.mark.parametrize("setting", SETTINGS)
def test_eagle_head_with_its_own_draft_vocabulary(world, plain, setting, tmp_path):
    """EAGLE with an LM head over 48 of the 64 ids (what drafts.train writes): chain steps map
    their argmax through d2t, tree steps place the draft logits at their target ids; on the
    exact target every draft is accepted, on the noisy one the outputs are no-spec's."""
    head = _synthetic_head("EAGLE", world.cfg, world.pi, world.subset, tmp_path / "head",
                           draft_vocab=True)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] == 48
    exact = _engine(world.exact, "EAGLE", head, **SETTINGS[setting])
    _exact_outputs_all_accepted(world, exact)
    state = exact.get_server_info()["internal_states"][0]
    assert state["avg_spec_accept_length"] == exact.spec.num_steps + 1
    noisy = _engine(world.noisy, "EAGLE", head, **SETTINGS[setting])
    outs = noisy.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch


class _Recorder:
    """Wraps the engine's head: records every catch-up (DRAFT_EXTEND without a tree mask) row
    with its request, position, token, raw target hidden (before EAGLE3's fc), the hidden the
    head was handed and what it returned; checks each chain DECODE step is handed the previous
    forward's output hidden of its request, and that at every catch-up neither the target nor
    the draft holds a KV slot past its committed tokens (rejected drafts and draft steps freed).
    reserves_ahead: overlapped steps hold slots ahead by design (SpecOverlap._shortfall), so
    those two checks are off."""

    def __init__(self, engine, reserves_ahead: bool = False):
        self.engine, self.draft, head = engine, engine.draft, engine.draft.model
        self.reserves_ahead = reserves_ahead
        self.rows, self.raw, self.last_out, self.num_decode_checked = [], None, {}, 0
        forward, project = head.forward, head.project_target_hidden

        def project_wrapper(hidden):
            self.raw = hidden.clone()
            return project(hidden)

        def forward_wrapper(input_ids, positions, aux_layers=(), input_hidden=None):
            out, nxt = forward(input_ids, positions, aux_layers, input_hidden=input_hidden)
            self._record(get_forward_context().batch, input_ids, positions, input_hidden, out,
                         nxt[0])
            return out, nxt

        head.forward, head.project_target_hidden = forward_wrapper, project_wrapper

    def _record(self, batch, input_ids, positions, hidden, out, nxt):
        pool_to_rid = {st.req_pool_idx: rid for rid, st in self.draft._reqs.items()}
        mode, row = batch.forward_mode, 0
        catch_up = mode == ForwardMode.DRAFT_EXTEND and batch.tree_mask is None
        if catch_up and not self.reserves_ahead:
            for req in self.engine.scheduler.running:
                assert len(self.engine.kv_cache.slots_of(req.req_pool_idx)) == req.num_cached
        # The device lengths: an overlapped step's bodies plan with the widest on the host.
        for pool_idx, n, seq_len in zip(batch.req_pool_indices.tolist(),
                                        batch.extend_seq_lens.tolist(), batch.seq_lens.tolist()):
            rid, rows = pool_to_rid[pool_idx], slice(row, row + n)
            row += batch.req_row_stride or n  # a round graph's catch-up: request i at i*stride
            if catch_up:
                held = len(self.draft.kv_cache.slots_of(pool_idx))
                # A round allocates its steps' slots (chain or tree) with the catch-up's.
                chain = self.draft.round.buf.steps if batch.req_row_stride else 0
                assert self.reserves_ahead or held in (seq_len, seq_len + chain), (held, seq_len)
                assert self.raw is not None and self.raw.shape[0] == batch.num_tokens
                for i in range(rows.start, rows.stop):
                    self.rows.append(dict(rid=rid, pos=int(positions[i]), id=int(input_ids[i]),
                                          raw=self.raw[i].clone(), hidden=hidden[i].clone(),
                                          out=out[i].clone(), nxt=nxt[i].clone()))
            elif mode == ForwardMode.DECODE:  # chain draft step: fed its own last output
                torch.testing.assert_close(hidden[rows], self.last_out[rid], atol=0, rtol=0)
                self.num_decode_checked += 1
            self.last_out[rid] = nxt[rows.stop - 1:rows.stop].clone()
        self.raw = None


@torch.no_grad()
def _target_states(hf, seq):
    """Independent full-sequence HF forward: (final normed hidden [T, H], output of each layer)."""
    layer_outs = []
    hooks = [layer.register_forward_hook(
        lambda m, args, out: layer_outs.append((out[0] if isinstance(out, tuple) else out)[0]))
        for layer in hf.model.layers]
    try:
        final = hf.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
    finally:
        for hook in hooks:
            hook.remove()
    return final, layer_outs


def _dense_attention(num_heads, num_kv_heads, head_dim):
    def attention(q, k, v, layer_id, rotate=None):
        if rotate is not None:
            rotate[0](rotate[1], q, k)  # in place, as the model's attention does first
        t = q.shape[0]
        q = q.view(t, num_heads, head_dim).transpose(0, 1)
        k, v = (x.reshape(t, num_kv_heads, head_dim).transpose(0, 1)
                .repeat_interleave(num_heads // num_kv_heads, 0) for x in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [heads, t, head_dim]
        return out.transpose(0, 1).reshape(t, -1)
    return attention


def _check_rows_against_dense(world, algo, engine, recorder, outs, monkeypatch) -> None:
    """Each request's recorded catch-up rows: every position once, in order, handed the
    target's own states and token, and the head's outputs those of one dense forward of the
    head over the whole sequence."""
    head, spec = engine.draft.model, engine.draft.head_spec
    mc = head.config
    for prompt, out in zip(world.prompts, outs):
        seq = prompt + out["output_ids"]
        rows = sorted((r for r in recorder.rows if r["rid"] == out["meta_info"]["id"]),
                      key=lambda r: r["pos"])
        num = len(rows)
        assert [r["pos"] for r in rows] == list(range(num))  # each position once, no gap
        assert len(prompt) <= num < len(seq)
        assert [r["id"] for r in rows] == seq[1:num + 1]
        final, layer_outs = _target_states(world.noisy_hf, seq[:num])
        if algo == "EAGLE3":
            want_raw = torch.cat([layer_outs[i] for i in sorted(spec.aux_layer_ids)], -1)
        else:
            want_raw = final
        raw = torch.stack([r["raw"] for r in rows])
        torch.testing.assert_close(raw, want_raw, atol=1e-4, rtol=1e-5)
        with torch.no_grad():
            want_hidden = type(head).project_target_hidden(head, want_raw)
        torch.testing.assert_close(torch.stack([r["hidden"] for r in rows]), want_hidden,
                                   atol=1e-4, rtol=1e-5)
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(llama_module, "attention",
                      _dense_attention(mc.num_heads, mc.num_kv_heads, mc.head_dim))
            want_out, (want_nxt,) = type(head).forward(
                head, torch.tensor(seq[1:num + 1]), torch.arange(num), (), input_hidden=want_hidden)
        torch.testing.assert_close(torch.stack([r["out"] for r in rows]), want_out,
                                   atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(torch.stack([r["nxt"] for r in rows]), want_nxt,
                                   atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("algo", ALGOS)
def test_head_is_handed_the_target_states_of_each_position(world, plain, algo, setting,
                                                           monkeypatch):
    """Every target position reaches the head once, in order, as (token p + 1, the target's own
    state at p: final normed hidden, or EAGLE3's aux layers concatenated in layer order), equal
    to an independent full-sequence forward of the target; the head's outputs equal one dense
    forward of the head over the whole sequence (its paged KV, truncation after draft steps and
    catch-ups are right). Prompts are prefilled in chunks of 16 tokens."""
    engine = _engine(world.noisy, algo, world.heads[algo], chunked_prefill_size=16,
                     **SETTINGS[setting])
    recorder = _Recorder(engine)
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    _check_rows_against_dense(world, algo, engine, recorder, outs, monkeypatch)
    if setting == "chain":
        assert recorder.num_decode_checked > 0


@pytest.mark.parametrize("algo", ALGOS)
def test_head_resumes_every_position_after_plain_steps(world, plain, algo, monkeypatch):  # noqa: F811
    """Adaptive speculation, one speculative step after every 3 plain ones: before each
    speculative step the head catches up on the plain steps' positions through its resume
    runners (drafts/resume.py; here their bodies, what the graphs replay). Every position still
    reaches the head once, in order, and its outputs are a dense forward's: the runners wrote
    its KV where an eager catch-up would."""
    if not HAS_CPU_TRITON:
        pytest.skip("needs triton and the interpreter (TRITON_INTERPRET=1)")
    from tests.test_adaptive_engine import Stretches

    engine = _engine(world.noisy, algo, world.heads[algo], attention_backend="triton",
                     disable_adaptive_speculation=False)
    engine.scheduler.adaptive = Stretches(3)
    replays = []
    for rnd in engine.draft.resume.runners:
        monkeypatch.setattr(rnd, "catch_up", lambda *a, run=rnd.catch_up: replays.append(a[0])
                            or run(*a))
    recorder = _Recorder(engine, reserves_ahead=True)
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    assert len(replays) >= 3
    _check_rows_against_dense(world, algo, engine, recorder, outs, monkeypatch)


# ---- 1b. the default model on GSM8K prompts ---------------------------------------------------

def test_default_model_gsm8k_eagle3_random_head_is_lossless(tmp_path, monkeypatch):
    from specpcg.gsm8k import build_prompts

    prompts = build_prompts(2, num_shots=1)[0]
    params = {"max_new_tokens": 16, "temperature": 0}
    plain = Engine(device="cpu", max_total_tokens=4096, show_progress=False)
    ref = plain.generate(prompt=prompts, sampling_params=params)
    want = [o["output_ids"] for o in ref]
    loaded = (plain.model, plain.model_config, plain.tokenizer)
    plain.shutdown()
    cfg = loaded[1]
    head, spec = random_head("EAGLE3", cfg, "cpu", torch.float32, draft_vocab_size=4096,
                             intermediate_size=256)
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:4096].sort()
    head.set_d2t(ids.values - torch.arange(4096))
    save_head(head, spec, cfg, str(tmp_path / "eagle3"))
    # The same target weights without a second GGUF load (most of this test's time on a CPU).
    monkeypatch.setattr(engine_module, "load_target", lambda cfg, device, dtype: loaded)
    engine = Engine(device="cpu", max_total_tokens=4096, show_progress=False,
                    speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=str(tmp_path / "eagle3"))
    outs = engine.generate(prompt=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == want
    assert all(len(w) > 1 for w in want)
    assert [o["text"] for o in outs] == [o["text"] for o in ref]
    for out in outs:
        _check_spec_meta(out["meta_info"], 4)
    assert engine.get_server_info()["speculative"]["draft"]["aux_layer_ids"] == [1, 14, 26]
    _check_no_leak(engine)


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_the_tree_round_proposes_what_the_eager_tree_steps_propose(world, algo, monkeypatch):
    """The tree round's body (what its graph captures) and the eager tree steps draft the same
    trees: the same tokens out, and every request accepts the same counts in the same order."""
    from drafts.eagle import HeadDraft

    def run(eager: bool):
        engine = _engine(world.noisy, algo, world.heads[algo], **SETTINGS["tree"])
        if eager:
            engine.draft.tree_round = None
        proposals = []
        propose = HeadDraft.propose

        def record(self, reqs, spec):
            p = propose(self, reqs, spec)
            proposals.append((p.draft_tokens.tolist(), p.parents.tolist()))
            return p

        with monkeypatch.context() as m:
            m.setattr(HeadDraft, "propose", record)
            outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
        stats = {(s["mode"], s["runner"]) for s in engine.draft.router.forward_stats()}
        return [o["output_ids"] for o in outs], proposals, stats

    got, rounds, stats = run(eager=False)
    want, eager, eager_stats = run(eager=True)
    assert ("DRAFT_EXTEND", "draft_round_eager") in stats  # the round's bodies ran
    assert ("DRAFT_EXTEND", "draft_round_eager") not in eager_stats
    assert got == want and rounds == eager and len(rounds) > 3


def test_target_hidden_rows_of_their_own_share_no_storage_with_the_forward():
    """A plain step's rows are logged across steps (drafts/plain_log.py) while a decode
    graph's replay overwrites its output buffers: own=True rows are a copy (the aux layers'
    concatenation is one already), own=False ones a view of the final layer."""
    from types import SimpleNamespace

    from drafts.base import DraftWorker
    from specpcg.core import ModelOutput

    out = ModelOutput(logits=None, hidden_states=torch.randn(4, 8),
                      aux_hidden_states=[torch.randn(4, 8) for _ in range(3)])
    sources = [out.hidden_states.data_ptr()] + [a.data_ptr() for a in out.aux_hidden_states]
    for aux_layers, want in (((), out.hidden_states),
                             ((1, 2, 3), torch.cat(out.aux_hidden_states, dim=-1))):
        draft = SimpleNamespace(aux_layers=aux_layers)
        rows = DraftWorker.target_hidden(draft, out, own=True)
        assert torch.equal(rows, want) and rows.data_ptr() not in sources
    view = DraftWorker.target_hidden(SimpleNamespace(aux_layers=()), out)
    assert view.data_ptr() == out.hidden_states.data_ptr()
