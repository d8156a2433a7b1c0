"""EAGLE, EAGLE3 and NEXTN draft heads on CPU (fp32).

Most tests run on a hand-built 4-layer Llama target over a 64-token vocabulary whose embeddings
are one-hot (8 * e_t) and whose LM head maps coordinate t to token pi(t), pi a permutation made
of two long cycles (48 tokens S, 16 others). With its attention and MLP outputs zeroed ("exact")
the target's greedy continuation is t -> pi(t); with small random attention and MLP outputs
("noisy") it follows pi most of the time and depends on its context the rest of the time.

Every head is built by hand (`_synthetic_head`): it reads ONLY the target hidden state it is
handed (its fc / eh_proj ignores the token embedding), and its MLP moves the one-hot from t to
pi(t). Handed the target's state at position p (which encodes t_p) it predicts pi(pi(t_p)) =
t_{p+2}, which is exactly right on the exact target; handed any other position's state it is
wrong every time (pi has no cycle shorter than 16). Its attention output is small but not zero,
so the head's own KV cache also shapes its outputs (checked against a dense recomputation).
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import specpcg.engine as engine_module
import specpcg.models.llama as llama_module
from drafts.eagle import HeadDraft
from drafts.head_checkpoint import load_head, random_head, save_head
from specpcg import Engine
from specpcg.core import CaptureHiddenMode, ForwardMode
from specpcg.forward_context import get_forward_context
from specpcg.models.loader import load_checkpoint

ALGOS = ("EAGLE", "EAGLE3", "NEXTN")
TREE = dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=6,
            attention_backend="torch")
SETTINGS = {"chain": {}, "tree": TREE}
V = H = 64  # vocabulary == hidden size: one-hot embeddings
NUM_LAYERS = 4  # EAGLE3's default aux layers (0, 2, 3) are distinct
SCALE = 8.0  # embedding 8 * e_t has RMS 1, so RMSNorm (weight 1) leaves it unchanged
NOISE = 1.25  # the noisy target's attention / MLP output scale: it leaves pi ~1 step in 12
DRAFT_VOCAB = 48  # EAGLE3's draft vocabulary: the tokens of the long cycle S
NO_CUDA = "no CUDA device (device is cpu)"
LENGTHS = (1, 2, 5, 9, 13, 20, 31, 40)  # the batch's prompt lengths
EOS = 2  # transformers' LlamaConfig default eos_token_id


# ---- the synthetic target and heads ----------------------------------------------------------

def _cycles(gen):
    """pi: one cycle over a random subset S of DRAFT_VOCAB tokens, one over the rest."""
    perm = torch.randperm(V, generator=gen)
    subset, rest = perm[:DRAFT_VOCAB].sort().values, perm[DRAFT_VOCAB:].sort().values
    pi = torch.empty(V, dtype=torch.long)
    for group in (subset, rest):
        order = group[torch.randperm(len(group), generator=gen)]
        pi[order] = order.roll(-1)
    return pi, subset


def _perm_head_weight(pi):
    w = torch.zeros(V, H)  # row pi(t) reads coordinate t: logits of 8 * e_t peak at pi(t)
    w[pi, torch.arange(V)] = 1.0
    return w


def _permutation_target(path, pi, noise: float, seed: int):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128,
                         num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
                         rope_theta=10000.0)
    model = tf.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "o_proj" in name or "down_proj" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * noise / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        model.model.embed_tokens.weight.copy_(SCALE * torch.eye(V))
        model.lm_head.weight.copy_(_perm_head_weight(pi))
    model.save_pretrained(path)
    return model


def _shift_mlp(mlp, pi):
    """x + mlp(x) = 8 e_pi(t) for x = 8 e_t: gate/up keep coordinate t, down moves it to pi(t)."""
    inter = mlp.down_proj.weight.shape[1]
    gate_up = torch.zeros(2 * inter, H)
    gate_up[:H] = torch.eye(H)
    gate_up[inter:inter + H] = torch.eye(H)
    move = -torch.eye(H)
    move[pi, torch.arange(H)] += 1.0
    down = torch.zeros(H, inter)
    down[:, :H] = move / F.silu(torch.tensor(SCALE))
    mlp.gate_up_proj.weight.copy_(gate_up)
    mlp.down_proj.weight.copy_(down)


def _synthetic_head(algo, cfg, pi, subset, out_dir):
    """A head that predicts pi(pi(t_p)) from the target hidden state at p (see the docstring)."""
    head, spec = random_head(algo, cfg, "cpu", torch.float32, seed=3,
                             draft_vocab_size=DRAFT_VOCAB if algo == "EAGLE3" else 0)
    hidden_only = torch.cat([torch.zeros(H, H), torch.eye(H)], 1)  # [H, 2H]: [0 | I]
    with torch.no_grad():
        if algo == "EAGLE":
            head.fc.weight.copy_(hidden_only)
            layer = head.layers[0]
        elif algo == "NEXTN":
            head.eh_proj.weight.copy_(hidden_only)
            layer = head.layer
        else:  # the first aux layer's state (layer 0's output) goes through unchanged
            head.fc.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1))
            layer = head.midlayer
            head.lm_head.weight.copy_(_perm_head_weight(pi)[subset])  # draft id d: token S[d]
            head.set_d2t(subset - torch.arange(DRAFT_VOCAB))
        gen = torch.Generator().manual_seed(4)
        qkv = layer.self_attn.qkv_proj.weight
        qkv.copy_(torch.randn(qkv.shape, generator=gen) / qkv.shape[1] ** 0.5)
        o = layer.self_attn.o_proj.weight  # small: attention shapes outputs, not predictions
        o.copy_(torch.randn(o.shape, generator=gen) * 0.05)
        _shift_mlp(layer.mlp, pi)
    save_head(head, spec, cfg, str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    pi, subset = _cycles(torch.Generator().manual_seed(0))
    _permutation_target(root / "exact", pi, 0.0, seed=1)
    noisy_hf = _permutation_target(root / "noisy", pi, NOISE, seed=1)
    cfg, _ = load_checkpoint(str(root / "noisy"))
    heads = {a: _synthetic_head(a, cfg, pi, subset, root / f"head_{a}") for a in ALGOS}
    gen = torch.Generator().manual_seed(2)
    prompts = [subset[torch.randint(0, DRAFT_VOCAB, (n,), generator=gen)].tolist() for n in LENGTHS]
    eos_ahead = EOS  # requests 0, 3, 6 stop at EOS: their prompts end 6 pi-steps before it
    for _ in range(6):
        eos_ahead = int(torch.argsort(pi)[eos_ahead])
    for i in (0, 3, 6):
        prompts[i][-1] = eos_ahead
    params = [{"max_new_tokens": 10 + 2 * i, "temperature": 0, "ignore_eos": i % 3 != 0}
              for i in range(len(prompts))]
    return SimpleNamespace(root=root, pi=pi, subset=subset, cfg=cfg, exact=str(root / "exact"),
                           noisy=str(root / "noisy"), noisy_hf=noisy_hf, heads=heads,
                           prompts=prompts, params=params)


def _engine(target, algo=None, head=None, **kw):
    if algo is not None:
        kw.update(speculative_algorithm=algo, speculative_draft_model_path=head)
    kw.setdefault("max_total_tokens", 4096)
    return Engine(model_path=target, device="cpu", dtype="float32", skip_tokenizer_init=True,
                  show_progress=False, **kw)


@pytest.fixture(scope="module")
def plain(world):
    engine = _engine(world.noisy)
    single = engine.generate(input_ids=world.prompts[0], sampling_params=world.params[0])
    batch = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in batch]
    assert "stop" in reasons and "length" in reasons, reasons  # EOS inside runs is exercised
    return SimpleNamespace(single=single["output_ids"], batch=[o["output_ids"] for o in batch],
                           reasons=reasons, model=engine.model)


def _check_spec_meta(meta, num_draft_tokens):
    for key in ("spec_verify_ct", "spec_accept_length", "spec_accept_rate",
                "spec_accepted_drafts", "spec_accept_histogram"):
        assert key in meta, key
    hist = meta["spec_accept_histogram"]
    assert len(hist) == num_draft_tokens
    assert sum(hist) == meta["spec_verify_ct"] > 0
    assert sum(m * n for m, n in enumerate(hist)) == meta["spec_accepted_drafts"]
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"]
                                                       / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] >= 1.0


def _check_no_leak(engine):
    kv = engine.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]
    draft_kv = engine.draft.kv_cache.info()
    assert draft_kv["free_slots"] == draft_kv["total_slots"]
    assert not engine.draft._reqs, "the draft kept state for finished requests"


# ---- 1. greedy lossless ------------------------------------------------------------------------

@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_is_lossless_single_and_batched(world, plain, algo, setting):
    engine = _engine(world.noisy, algo, world.heads[algo], **SETTINGS[setting])
    single = engine.generate(input_ids=world.prompts[0], sampling_params=world.params[0])
    assert single["output_ids"] == plain.single
    outs = engine.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == plain.reasons
    n = engine.spec.num_draft_tokens
    assert n == (6 if setting == "tree" else 4)
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
    outs = engine.generate(input_ids=world.prompts, sampling_params=[
        {**p, "ignore_eos": True} for p in world.params])
    steps = engine.spec.num_steps
    for prompt, params, out in zip(world.prompts, world.params, outs):
        want, token = [], prompt[-1]
        for _ in range(params["max_new_tokens"]):
            token = int(world.pi[token])
            want.append(token)
        assert out["output_ids"] == want
        hist = out["meta_info"]["spec_accept_histogram"]
        assert hist[steps] == sum(hist) == out["meta_info"]["spec_verify_ct"], hist
    state = engine.get_server_info()["internal_states"][0]
    assert state["avg_spec_accept_length"] == steps + 1
    _check_no_leak(engine)


class _Recorder:
    """Wraps the engine's head: records every catch-up (DRAFT_EXTEND without a tree mask) row
    with its request, position, token, raw target hidden (before EAGLE3's fc), the hidden the
    head was handed and what it returned; checks each chain DECODE step is handed the previous
    forward's output hidden of its request, and that at every catch-up neither the target nor
    the draft holds a KV slot past its committed tokens (rejected drafts and draft steps freed)."""

    def __init__(self, engine):
        self.engine, self.draft, head = engine, engine.draft, engine.draft.model
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
        if catch_up:
            for req in self.engine.scheduler.running:
                assert len(self.engine.kv_cache.slots_of(req.req_pool_idx)) == req.num_cached
        for pool_idx, n, seq_len in zip(batch.req_pool_indices.tolist(),
                                        batch.extend_seq_lens_cpu, batch.seq_lens_cpu):
            rid, rows = pool_to_rid[pool_idx], slice(row, row + n)
            row += n
            if catch_up:
                assert len(self.draft.kv_cache.slots_of(pool_idx)) == seq_len
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
    def attention(q, k, v, layer_id):
        t = q.shape[0]
        q = q.view(t, num_heads, head_dim).transpose(0, 1)
        k, v = (x.reshape(t, num_kv_heads, head_dim).transpose(0, 1)
                .repeat_interleave(num_heads // num_kv_heads, 0) for x in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [heads, t, head_dim]
        return out.transpose(0, 1).reshape(t, -1)
    return attention


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
    if setting == "chain":
        assert recorder.num_decode_checked > 0


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


# ---- 3. published checkpoint layouts -----------------------------------------------------------

def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen).to(dtype)


def _layer_tensors(prefix, gen, in_features=H, dtype=torch.float32, input_norm=False):
    """One Llama decoder layer under HF names (4 heads of 16, 2 KV heads, MLP 128)."""
    t = {f"{prefix}self_attn.q_proj.weight": _rand(gen, 64, in_features, dtype=dtype),
         f"{prefix}self_attn.k_proj.weight": _rand(gen, 32, in_features, dtype=dtype),
         f"{prefix}self_attn.v_proj.weight": _rand(gen, 32, in_features, dtype=dtype),
         f"{prefix}self_attn.o_proj.weight": _rand(gen, H, 64, dtype=dtype),
         f"{prefix}mlp.gate_proj.weight": _rand(gen, 128, H, dtype=dtype),
         f"{prefix}mlp.up_proj.weight": _rand(gen, 128, H, dtype=dtype),
         f"{prefix}mlp.down_proj.weight": _rand(gen, H, 128, dtype=dtype),
         f"{prefix}post_attention_layernorm.weight": _rand(gen, H, dtype=dtype)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = _rand(gen, H, dtype=dtype)
    return t


def _base_config(arch, **extra):
    return {"architectures": [arch] if arch else None, "model_type": "llama", "hidden_size": H,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "vocab_size": V, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": "bfloat16", **extra}


def _write_checkpoint(path, config, tensors):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def _load(path, algo, world, plain):
    return load_head(path, algo, world.cfg, plain.model, torch.device("cpu"), torch.float32)


def _check_layer(layer, tensors, prefix):
    g = lambda name: tensors[prefix + name].float()  # noqa: E731
    attn = layer.self_attn
    assert attn.qkv_proj.weight.equal(torch.cat([g("self_attn.q_proj.weight"),
                                                 g("self_attn.k_proj.weight"),
                                                 g("self_attn.v_proj.weight")]))
    assert attn.qkv_proj.weight[:64].equal(g("self_attn.q_proj.weight"))  # q rows come first
    assert attn.o_proj.weight.equal(g("self_attn.o_proj.weight"))
    assert layer.mlp.gate_up_proj.weight.equal(torch.cat([g("mlp.gate_proj.weight"),
                                                          g("mlp.up_proj.weight")]))
    assert layer.mlp.down_proj.weight.equal(g("mlp.down_proj.weight"))
    assert layer.post_attention_layernorm.weight.equal(g("post_attention_layernorm.weight"))


def test_eagle_layouts_load(world, plain, tmp_path):
    gen = torch.Generator().manual_seed(10)
    ids = torch.tensor([0, 5, 63])
    # EAGLE repository layout: bf16 tensors, fc with bias, the target's embedding and head.
    tensors = {"fc.weight": _rand(gen, H, 2 * H, dtype=torch.bfloat16),
               "fc.bias": _rand(gen, H, dtype=torch.bfloat16),
               **_layer_tensors("layers.0.", gen, dtype=torch.bfloat16)}
    path = _write_checkpoint(tmp_path / "eagle", _base_config("LlamaForCausalLMEagle"), tensors)
    head, spec = _load(path, "EAGLE", world, plain)
    assert (spec.algorithm, spec.fc_bias, spec.has_embed, spec.has_head) == ("EAGLE", True,
                                                                             False, False)
    assert head.fc.weight.dtype == torch.float32
    assert head.fc.weight.equal(tensors["fc.weight"].float())
    assert head.fc.bias.equal(tensors["fc.bias"].float())
    _check_layer(head.layers[0], tensors, "layers.0.")
    assert not hasattr(head.layers[0], "input_layernorm")  # EAGLE's layer 0 has no input norm
    assert head.embed(ids).equal(plain.model.model.embed_tokens(ids))
    assert head.head_weight is plain.model.head_weight

    # SGLang-style names with a `model.` prefix, its own embedding and LM head, no fc bias.
    tensors = {"model.fc.weight": _rand(gen, H, 2 * H),
               "model.embed_tokens.weight": _rand(gen, V, H), "lm_head.weight": _rand(gen, V, H),
               **_layer_tensors("model.layers.0.", gen)}
    path = _write_checkpoint(tmp_path / "prefixed", _base_config("LlamaForCausalLM"), tensors)
    head, spec = _load(path, "EAGLE", world, plain)
    assert (spec.fc_bias, spec.has_embed, spec.has_head) == (False, True, True)
    assert head.fc.bias is None and head.fc.weight.equal(tensors["model.fc.weight"])
    _check_layer(head.layers[0], tensors, "model.layers.0.")
    assert head.embed(ids).equal(tensors["model.embed_tokens.weight"][ids])
    assert head.head_weight.equal(tensors["lm_head.weight"])


def test_eagle3_specforge_layout_loads_with_d2t(world, plain, tmp_path):
    gen = torch.Generator().manual_seed(11)
    draft_vocab = 40
    target_ids = torch.randperm(V, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    tensors = {**_layer_tensors("midlayer.", gen, in_features=2 * H, input_norm=True),
               "midlayer.hidden_norm.weight": _rand(gen, H), "fc.weight": _rand(gen, H, 3 * H),
               "norm.weight": _rand(gen, H), "lm_head.weight": _rand(gen, draft_vocab, H),
               "d2t": target_ids - torch.arange(draft_vocab), "t2d": t2d}
    config = _base_config("LlamaForCausalLMEagle3", draft_vocab_size=draft_vocab,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    path = _write_checkpoint(tmp_path / "eagle3", config, tensors)
    head, spec = _load(path, "EAGLE3", world, plain)
    assert (spec.algorithm, spec.draft_vocab_size, spec.aux_layer_ids) == ("EAGLE3", draft_vocab,
                                                                           (0, 1, 3))
    # Our target records the residual stream entering layer i: layer i's output is i + 1.
    assert HeadDraft(head, spec).aux_layers == (1, 2, 4)
    _check_layer(head.midlayer, tensors, "midlayer.")
    assert head.midlayer.self_attn.qkv_proj.in_features == 2 * H
    assert head.midlayer.input_layernorm.weight.equal(tensors["midlayer.input_layernorm.weight"])
    assert head.midlayer.hidden_norm.weight.equal(tensors["midlayer.hidden_norm.weight"])
    assert head.fc.weight.equal(tensors["fc.weight"])
    assert head.norm.weight.equal(tensors["norm.weight"])
    assert head.lm_head.weight.equal(tensors["lm_head.weight"])
    assert head.draft_to_target.tolist() == target_ids.tolist()
    x = _rand(gen, 5, H)
    logits = head.compute_logits(x)  # [5, V]: draft logits at their target ids, -inf elsewhere
    draft_logits = x @ tensors["lm_head.weight"].T
    assert logits.shape == (5, V)
    torch.testing.assert_close(logits[:, target_ids], draft_logits)
    assert torch.isneginf(logits[:, ~t2d]).all()
    assert logits.argmax(-1).tolist() == target_ids[draft_logits.argmax(-1)].tolist()
    assert head.project_target_hidden(x.repeat(1, 3)).shape == (5, H)


def test_nextn_deepseek_layout_loads(world, plain, tmp_path):
    gen = torch.Generator().manual_seed(12)
    ids = torch.tensor([3, 7])
    p = f"model.layers.{NUM_LAYERS}."  # the MTP layer sits after the target's layers
    tensors = {f"{p}enorm.weight": _rand(gen, H), f"{p}hnorm.weight": _rand(gen, H),
               f"{p}eh_proj.weight": _rand(gen, H, 2 * H),
               f"{p}shared_head.norm.weight": _rand(gen, H),
               f"{p}shared_head.head.weight": _rand(gen, V, H),
               **_layer_tensors(p, gen, input_norm=True)}
    config = _base_config("LlamaForCausalLMNextN", num_hidden_layers=NUM_LAYERS,
                          num_nextn_predict_layers=1)
    head, spec = _load(_write_checkpoint(tmp_path / "nextn", config, tensors), "NEXTN", world,
                       plain)
    assert (spec.algorithm, spec.has_head, spec.has_embed) == ("NEXTN", True, False)
    for name in ("enorm", "hnorm", "eh_proj"):
        assert getattr(head, name).weight.equal(tensors[f"{p}{name}.weight"]), name
    assert head.shared_head.norm.weight.equal(tensors[f"{p}shared_head.norm.weight"])
    assert head.head_weight.equal(tensors[f"{p}shared_head.head.weight"])
    _check_layer(head.layer, tensors, p)
    assert head.layer.input_layernorm.weight.equal(tensors[f"{p}input_layernorm.weight"])
    assert head.embed(ids).equal(plain.model.model.embed_tokens(ids))

    # No architectures, only num_nextn_predict_layers; its own embedding, the target's head.
    del tensors[f"{p}shared_head.head.weight"]
    tensors[f"{p}embed_tokens.weight"] = _rand(gen, V, H)
    config = _base_config(None, num_hidden_layers=NUM_LAYERS, num_nextn_predict_layers=1)
    head, spec = _load(_write_checkpoint(tmp_path / "nextn2", config, tensors), "NEXTN", world,
                       plain)
    assert (spec.has_head, spec.has_embed) == (False, True)
    assert head.head_weight is plain.model.head_weight
    assert head.embed(ids).equal(tensors[f"{p}embed_tokens.weight"][ids])


def test_eagle3_full_vocab_d2t_is_applied(world):
    head, _ = random_head("EAGLE3", world.cfg, "cpu", torch.float32, draft_vocab_size=V)
    target_ids = torch.randperm(V, generator=torch.Generator().manual_seed(13))
    head.set_d2t(target_ids - torch.arange(V))  # draft id d is target id target_ids[d]
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(14))
    draft_logits = x @ head.lm_head.weight.T
    torch.testing.assert_close(head.compute_logits(x)[:, target_ids], draft_logits)


PUBLISHED_PREFIXES = {"EAGLE": ("fc.", "layers.0."),
                      "EAGLE3": ("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d"),
                      "NEXTN": (f"model.layers.{NUM_LAYERS}.",)}


@pytest.mark.parametrize("algo", ALGOS)
def test_save_load_round_trip(world, plain, tmp_path, algo):
    head, spec = random_head(algo, world.cfg, "cpu", torch.float32, seed=5,
                             draft_vocab_size=DRAFT_VOCAB, intermediate_size=96)
    if algo == "EAGLE3":
        head.set_d2t(world.subset - torch.arange(DRAFT_VOCAB))
    save_head(head, spec, world.cfg, str(tmp_path))
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert all(n.startswith(PUBLISHED_PREFIXES[algo]) for n in names), sorted(names)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)  # split again
    loaded, loaded_spec = _load(str(tmp_path), algo, world, plain)
    assert type(loaded) is type(head)
    want, got = head.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].equal(want[name]), name
    if algo == "EAGLE3":
        assert loaded.draft_to_target.equal(head.draft_to_target)
    for field in ("algorithm", "draft_vocab_size", "aux_layer_ids", "fc_bias", "has_embed",
                  "has_head"):
        assert getattr(loaded_spec, field) == getattr(spec, field), field
    for field in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "rms_norm_eps", "rope_theta", "num_layers"):
        assert getattr(loaded_spec.layer_cfg, field) == getattr(spec.layer_cfg, field), field


# ---- 4. clear errors -----------------------------------------------------------------------------

def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(changes)
    for key, value in changes.items():
        if value is None:
            del config[key]
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(config, f)


def _edit_tensors(path, drop=(), **replace):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in drop:
        del tensors[name]
    tensors.update(replace)
    save_file(tensors, file)


def _bad_hidden(p):
    _edit_config(p, hidden_size=32, head_dim=16)
    return r"EAGLE head hidden_size 32 does not match the target's hidden_size 64"


def _bad_vocab(p):
    _edit_config(p, vocab_size=100)
    return r"EAGLE head vocab_size 100 does not match the target's vocab_size 64"


def _bad_aux(p):
    _edit_config(p, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4]})
    return (r"eagle_aux_hidden_state_layer_ids \[0, 2, 4\] are not three distinct layers of the "
            r"4-layer target")


def _no_config(p):
    os.remove(os.path.join(p, "config.json"))
    return r"has no config\.json"


def _corrupt(p):
    with open(os.path.join(p, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    return r"model\.safetensors is not a readable safetensors file"


def _no_weights(p):
    os.remove(os.path.join(p, "model.safetensors"))
    return r"has no \*\.safetensors weights"


def _missing_tensor(p):
    _edit_tensors(p, drop=["layers.0.mlp.down_proj.weight"])
    return r"does not match its config: missing \['layers\.0\.mlp\.down_proj\.weight'\]"


def _missing_eagle3_tensor(p):
    _edit_tensors(p, drop=["midlayer.hidden_norm.weight"])
    return r"missing \['midlayer\.hidden_norm\.weight'\]"


def _missing_dir(p):
    shutil.rmtree(p)
    return r"is not a directory"


# (algorithm of the checkpoint, algorithm asked for, corruption) -> the message's regex
BAD_CHECKPOINTS = {
    "hidden_size": ("EAGLE", "EAGLE", _bad_hidden),
    "vocab_size": ("EAGLE", "EAGLE", _bad_vocab),
    "aux_layers_out_of_range": ("EAGLE3", "EAGLE3", _bad_aux),
    "eagle3_as_eagle": ("EAGLE3", "EAGLE", lambda p: r"holds a EAGLE3 head, but "
                                                     r"speculative_algorithm is 'EAGLE'"),
    "nextn_as_eagle3": ("NEXTN", "EAGLE3", lambda p: r"holds a NEXTN head, but "
                                                     r"speculative_algorithm is 'EAGLE3'"),
    "missing_dir": ("EAGLE", "EAGLE", _missing_dir),
    "no_config": ("EAGLE", "EAGLE", _no_config),
    "corrupt_safetensors": ("EAGLE", "EAGLE", _corrupt),
    "no_weights": ("NEXTN", "NEXTN", _no_weights),
    "missing_tensor": ("EAGLE", "EAGLE", _missing_tensor),
    "missing_eagle3_tensor": ("EAGLE3", "EAGLE3", _missing_eagle3_tensor),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
def test_bad_head_checkpoint_is_refused(world, tmp_path, case):
    stored, asked, corrupt = BAD_CHECKPOINTS[case]
    path = str(tmp_path / "head")
    shutil.copytree(world.heads[stored], path)
    pattern = corrupt(path)
    with pytest.raises(ValueError, match=pattern) as err:
        _engine(world.noisy, asked, path)
    assert f"speculative_draft_model_path {path!r}" in str(err.value)


@pytest.mark.parametrize("algo", ALGOS)
def test_missing_draft_path_is_refused(world, algo):
    with pytest.raises(ValueError, match=f"speculative_draft_model_path is required for {algo}"):
        _engine(world.noisy, algo, None)


# Invariant 7 asks for a ValueError naming the field; these still escape as other types.
def test_wrong_tensor_shape_is_a_value_error(world, tmp_path):
    path = str(tmp_path / "head")
    shutil.copytree(world.heads["EAGLE"], path)
    _edit_tensors(path, **{"layers.0.mlp.down_proj.weight": torch.zeros(H, 96)})
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight"):
        _engine(world.noisy, "EAGLE", path)


def test_config_without_a_field_is_a_value_error(world, tmp_path):
    path = str(tmp_path / "head")
    shutil.copytree(world.heads["EAGLE"], path)
    _edit_config(path, intermediate_size=None)
    with pytest.raises(ValueError, match="intermediate_size"):
        _engine(world.noisy, "EAGLE", path)


def test_engines_work_after_failed_constructions(world, plain, tmp_path):
    path = str(tmp_path / "head")
    shutil.copytree(world.heads["EAGLE3"], path)
    _edit_config(path, vocab_size=100)
    for _ in range(2):
        with pytest.raises(ValueError):
            _engine(world.noisy, "EAGLE3", path)
    with pytest.raises(ValueError):
        _engine(world.noisy, "EAGLE", world.heads["EAGLE3"])
    assert torch.get_default_dtype() == torch.float32
    fresh = _engine(world.noisy)
    outs = fresh.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    spec = _engine(world.noisy, "EAGLE3", world.heads["EAGLE3"])
    outs = spec.generate(input_ids=world.prompts, sampling_params=world.params)
    assert [o["output_ids"] for o in outs] == plain.batch
    _check_no_leak(spec)


# ---- 5. invariant 4 (and 5) on CPU ---------------------------------------------------------------

@pytest.mark.parametrize("algo", ALGOS)
def test_graph_needs_server_info_and_forward_stats(world, algo, monkeypatch):
    import drafts.wiring as wiring_module

    calls = {}

    def recording(name, build):
        def wrapper(cfg, runner, context_len, **kw):
            calls[name] = (cfg, kw)
            return build(cfg, runner, context_len, **kw)
        return wrapper

    monkeypatch.setattr(engine_module, "build_graphs",
                        recording("target", engine_module.build_graphs))
    monkeypatch.setattr(wiring_module, "build_graphs",
                        recording("draft", wiring_module.build_graphs))
    engine = _engine(world.noisy, algo, world.heads[algo])
    # The target's graphs are built for every hidden state the draft reads (invariant 4) ...
    aux = (1, 3, 4) if algo == "EAGLE3" else ()  # default aux ids (0, 2, 3), as entering ids
    assert engine.draft.needs_hidden == CaptureHiddenMode.FULL
    assert engine.draft.aux_layers == aux
    assert calls["target"][1] == {"hidden_mode": CaptureHiddenMode.FULL, "aux_layers": aux,
                                  "num_verify_tokens": 4}
    # ... and the draft's never include piecewise graphs (invariant 5).
    draft_cfg, draft_kw = calls["draft"]
    assert draft_cfg.disable_piecewise_cuda_graph and not engine.draft.builds_piecewise
    assert draft_kw["hidden_mode"] == CaptureHiddenMode.LAST
    assert engine.draft.graphs.piecewise is None

    out = engine.generate(input_ids=world.prompts[3], sampling_params={
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    verify_ct = out["meta_info"]["spec_verify_ct"]
    info = engine.get_server_info()
    assert info["piecewise_cuda_graph"] == {"enabled": False, "reason": NO_CUDA}
    assert info["cuda_graph"] == {"enabled": False, "reason": NO_CUDA}
    draft_info = info["speculative"]["draft"]
    assert draft_info["name"] == algo
    assert draft_info["aux_layer_ids"] == ([0, 2, 3] if algo == "EAGLE3" else [])
    assert draft_info["piecewise_cuda_graph"]["enabled"] is False
    assert draft_info["piecewise_cuda_graph"]["reason"]
    target_stats = {s["mode"]: s for s in info["forward_stats"]}
    assert set(target_stats) == {"EXTEND", "TARGET_VERIFY"}  # no plain DECODE with a draft
    assert target_stats["EXTEND"] == {"mode": "EXTEND", "runner": "eager", "reason": NO_CUDA,
                                      "count": 1}
    assert target_stats["TARGET_VERIFY"] == {"mode": "TARGET_VERIFY", "runner": "eager",
                                             "reason": NO_CUDA, "count": verify_ct}
    draft_stats = {s["mode"]: s for s in engine.draft.router.forward_stats()}
    assert set(draft_stats) == {"DRAFT_EXTEND", "DECODE"}  # drafts never prefill or verify
    assert draft_stats["DRAFT_EXTEND"]["count"] == verify_ct  # one catch-up per round
    assert draft_stats["DECODE"]["count"] == (engine.spec.num_steps - 1) * verify_ct
    assert draft_stats["DECODE"]["reason"] == NO_CUDA
    assert all(s["runner"] == "eager" and s["reason"] for s in draft_stats.values())
