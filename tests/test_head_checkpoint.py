"""Draft-head checkpoints: the published EAGLE / EAGLE3 / NEXTN layouts load, round trip, and
every bad checkpoint is refused with a ValueError naming the path and the values."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts.eagle import HeadDraft
from drafts.head_checkpoint import load_head, random_head, save_head

from tests.eagle_world import (  # noqa: F401 (fixtures)
    ALGOS, V, H, NUM_LAYERS, DRAFT_VOCAB, world, plain, _engine, _check_no_leak,
    _rand, _layer_tensors, _base_config, _write_checkpoint)


# ---- 3. published checkpoint layouts -----------------------------------------------------------

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


PUBLISHED_PREFIXES = {"EAGLE": ("fc.", "layers.0.", "lm_head.", "d2t", "t2d"),
                      "EAGLE3": ("fc.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d"),
                      "NEXTN": (f"model.layers.{NUM_LAYERS}.",)}


@pytest.mark.parametrize("algo", ALGOS)
def test_save_load_round_trip(world, plain, tmp_path, algo):
    head, spec = random_head(algo, world.cfg, "cpu", torch.float32, seed=5,
                             draft_vocab_size=DRAFT_VOCAB, intermediate_size=96)
    if algo != "NEXTN":  # EAGLE and EAGLE3 keep their own LM head over a draft vocabulary
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
    if algo != "NEXTN":
        assert loaded.draft_to_target.equal(head.draft_to_target)
        assert loaded.draft_to_target.equal(world.subset)
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
