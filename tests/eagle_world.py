"""The synthetic world of the EAGLE-family CPU tests (test_eagle.py, test_head_checkpoint.py).


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

from types import SimpleNamespace

import json
import os

import pytest
import torch
from safetensors.torch import save_file
import torch.nn.functional as F

from drafts.head_checkpoint import random_head, save_head
from specpcg import Engine
from specpcg.models.loader import load_checkpoint

ALGOS = ("EAGLE", "EAGLE3", "NEXTN")
TREE = dict(speculative_eagle_topk=3, speculative_num_steps=3, speculative_num_draft_tokens=6,
            attention_backend="torch")
SETTINGS = {"chain": {}, "tree": TREE}
V = H = 64  # vocabulary == hidden size: one-hot embeddings
NUM_LAYERS = 4  # EAGLE3's default aux layers (0, 2, 3) are distinct
SCALE = 8.0  # embedding 8 * e_t has RMS 1, so RMSNorm (weight 1) leaves it unchanged
NOISE = 1.25  # the noisy target's attention / MLP output scale: it leaves pi ~1 step in 12
DRAFT_VOCAB = 48  # a draft vocabulary (EAGLE3's, EAGLE's own): the tokens of the long cycle S
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


def _synthetic_head(algo, cfg, pi, subset, out_dir, draft_vocab: bool = False):
    """A head that predicts pi(pi(t_p)) from the target hidden state at p (see the docstring).
    draft_vocab: its own LM head over the tokens of S, mapped by d2t (EAGLE3 always; EAGLE as
    drafts.train writes it); otherwise EAGLE and NEXTN share the target's LM head."""
    draft_vocab = draft_vocab or algo == "EAGLE3"
    head, spec = random_head(algo, cfg, "cpu", torch.float32, seed=3,
                             draft_vocab_size=DRAFT_VOCAB if draft_vocab else 0)
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
        if draft_vocab:
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
    # These tests look at every speculative step: adaptive speculation would mix in plain ones.
    kw.setdefault("disable_adaptive_speculation", True)
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
    spec_tokens = meta["completion_tokens"] - meta["plain_decode_tokens"]
    assert meta["spec_accept_length"] == pytest.approx(spec_tokens / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] >= 1.0


def _exact_outputs_all_accepted(world, engine) -> list:
    """Generates every prompt on the exact target (no EOS stop); checks each output follows pi
    and every verify accepted all its drafts. Returns the outputs."""
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
    return outs


def same_as_sync(over: list, sync: list, num_nodes: int) -> list:
    """Asserts an overlapped run emitted the synchronous run's tokens with the same verifies,
    acceptance and finish reasons; returns the summed acceptance histogram."""
    assert [o["output_ids"] for o in over] == [o["output_ids"] for o in sync]
    for a, b in zip(over, sync):
        for key in ("spec_verify_ct", "spec_accept_histogram", "finish_reason"):
            assert a["meta_info"][key] == b["meta_info"][key], key
    return [sum(o["meta_info"]["spec_accept_histogram"][k] for o in over)
            for k in range(num_nodes)]


def _check_no_leak(engine):
    kv = engine.get_server_info()["kv_cache"]
    assert kv["free_slots"] == kv["total_slots"]
    draft_kv = engine.draft.kv_cache.info()
    assert draft_kv["free_slots"] == draft_kv["total_slots"]
    assert not engine.draft._reqs, "the draft kept state for finished requests"


# ---- checkpoints written by hand in the published layouts ------------------------------------

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
