"""drafts.train on CPU: EAGLE / EAGLE3 / NEXTN heads and a STANDALONE draft trained on a tiny
4-layer target (synthetic prompts as token ids: no tokenizer), the trainer's options, cache
keys, labels and held-out split. The dense attention it trains through: test_dense_attention."""

import json

import pytest
import torch

from drafts.head_checkpoint import random_head, save_head
from drafts.train import train_draft
from drafts.train_standalone import save_standalone, truncated_model
from specpcg import Engine
from specpcg.models.build import build_model
from specpcg.models.config import ModelConfig

H, HKV, D = 4, 2, 8  # attention heads, kv heads, head dim of the small models
CPU = torch.device("cpu")
GREEDY = {"max_new_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops on a shared CPU: a second intra-op thread costs far more than it saves."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _tiny_target(path) -> str:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2)
    torch.manual_seed(0)  # wide init: greedy outputs vary instead of repeating one token
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _engine(target, **kw):
    return Engine(model_path=target, skip_tokenizer_init=True, device="cpu", dtype="float32",
                  max_total_tokens=4096, show_progress=False, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target dir, plain engine, prompts, plain greedy outputs): 12 prompts sharing a prefix."""
    target = _tiny_target(tmp_path_factory.mktemp("target"))
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 128, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 128, (6,), generator=gen).tolist() for _ in range(12)]
    engine = _engine(target)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    return target, engine, prompts, [o["output_ids"] for o in outs]


def _accept_length(target, algorithm, draft_dir, prompts) -> tuple:
    engine = _engine(target, speculative_algorithm=algorithm,
                     speculative_draft_model_path=str(draft_dir))
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    accept = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    return [o["output_ids"] for o in outs], accept


def _untrained_draft(algorithm, target, target_cfg, out) -> str:
    """What training starts from: a random head, or the target's first layer (STANDALONE)."""
    if algorithm == "STANDALONE":
        model, cfg = truncated_model(target, 1, CPU)
        return save_standalone(model, cfg, target, out)
    head, spec = random_head(algorithm, target_cfg, CPU, torch.float32, draft_vocab_size=96)
    return save_head(head, spec, target_cfg, out)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
def test_trained_draft_learns_loads_and_beats_its_start(algorithm, tiny, tmp_path):
    target, engine, prompts, plain = tiny
    out = train_draft(algorithm, target, prompts, str(tmp_path / "draft"), engine=engine,
                      max_new_tokens=GREEDY["max_new_tokens"], max_steps=80, lr=3e-3,
                      minutes=10, draft_vocab_size=96, num_layers=1, ttt_steps=3,
                      show_progress=False)
    log = json.loads((tmp_path / "draft" / "train_log.json").read_text())
    assert log["steps"] == 80 and len(log["heldout_top1"]) == (
        1 if algorithm == "STANDALONE" else 3)
    assert set(log["offline_accept"]) == {"3,1,4", "7,1,8"}
    assert log["offline_accept_length"] == log["offline_accept"]["3,1,4"]["accept_length"] >= 1
    assert log["offline_accept_by_source"] == {"ids": log["offline_accept"]}  # one source here
    assert log["final_loss"] < 0.7 * log["initial_loss"], log["loss_curve"]
    curve = log["heldout_top1_curve"]  # held-out top-1 at a quarter, half and 3/4 of the run
    assert [p["step"] for p in curve] == [20, 40, 60]
    assert all(len(p["top1"]) == len(log["heldout_top1"]) for p in curve)
    if algorithm in ("EAGLE", "EAGLE3"):  # their own LM head over the 96 most used ids
        config = json.loads((tmp_path / "draft" / "config.json").read_text())
        assert config["draft_vocab_size"] == 96
    if algorithm != "STANDALONE":  # 96 of 128 ids: some held-out labels fall outside
        assert 0 < log["heldout_vocab_coverage"] <= 1
        assert log["heldout_vocab_coverage"] >= log["heldout_top1"][0]

    trained_ids, trained_accept = _accept_length(target, algorithm, out, prompts)
    assert trained_ids == plain  # greedy speculative decoding is lossless
    start = _untrained_draft(algorithm, target, engine.model_config, str(tmp_path / "start"))
    _, start_accept = _accept_length(target, algorithm, start, prompts)
    assert trained_accept > start_accept + 0.3, (trained_accept, start_accept)


def test_eagle3_fuses_the_layers_it_was_trained_on(tiny, tmp_path):
    """aux_layer_ids picks the target layers an EAGLE3 head trains on; the checkpoint names them
    and the engine captures those layers (the default would be (0, 2, 3) on 4 layers)."""
    target, engine, prompts, plain = tiny
    out = train_draft("EAGLE3", target, prompts, str(tmp_path / "draft"), engine=engine,
                      max_new_tokens=GREEDY["max_new_tokens"], max_steps=3, minutes=10,
                      draft_vocab_size=96, aux_layer_ids=(0, 1, 3), ttt_steps=2,
                      show_progress=False)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    spec_engine = _engine(target, speculative_algorithm="EAGLE3",
                          speculative_draft_model_path=out)
    info = spec_engine.get_server_info()["speculative"]["draft"]
    assert info["aux_layer_ids"] == [0, 1, 3] and info["target_aux_layers"] == [1, 2, 4]
    outs = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain


def test_a_wider_head_saves_its_width_and_the_engine_loads_it(tiny, tmp_path):
    target, engine, prompts, plain = tiny
    out = train_draft("EAGLE", target, prompts, str(tmp_path / "draft"), engine=engine,
                      max_new_tokens=GREEDY["max_new_tokens"], max_steps=3, minutes=10,
                      ttt_steps=2, head_intermediate_size=200, show_progress=False)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["intermediate_size"] == 200  # the target's is 128
    spec_engine = _engine(target, speculative_algorithm="EAGLE", speculative_draft_model_path=out)
    outs = spec_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    with pytest.raises(ValueError, match="head_intermediate_size must be an integer >= 0"):
        train_draft("EAGLE", target, prompts, str(tmp_path / "bad"), engine=engine,
                    head_intermediate_size=-1)


@pytest.mark.parametrize("aux", [(1, 1, 2), (0, 1), (0, 1, -2), [0, 1, True]])
def test_bad_aux_layer_ids_are_refused(aux):
    from drafts.train import TrainOptions

    with pytest.raises(ValueError, match="aux_layer_ids must be three distinct"):
        TrainOptions.from_kwargs({"aux_layer_ids": aux})


def test_aux_layer_ids_past_the_target_are_refused(tiny, tmp_path):
    target, engine, prompts, _ = tiny
    with pytest.raises(ValueError, match=r"aux_layer_ids \[0, 1, 4\] name layers past the "
                                         r"target's 4"):
        train_draft("EAGLE3", target, prompts, str(tmp_path / "d"), engine=engine,
                    max_new_tokens=4, max_steps=1, minutes=10, aux_layer_ids=(0, 1, 4),
                    show_progress=False)


def test_minutes_bound_the_whole_run():
    """The loop gets what generation and features left of `minutes`, less the finishing
    margin; a budget they already spent is refused with the figures."""
    from drafts.train import TrainOptions, _loop_minutes, finish_margin_s

    o = TrainOptions(minutes=8.0)
    for algorithm in ("EAGLE3", "STANDALONE"):
        margin = finish_margin_s(algorithm)
        assert _loop_minutes(o, 100.0, margin) * 60 == pytest.approx(480.0 - 100.0 - margin)
    # STANDALONE's held-out simulation runs a 4-layer model: it keeps more than a head
    assert finish_margin_s("STANDALONE") > finish_margin_s("EAGLE3") > 0
    with pytest.raises(RuntimeError, match=r"took 70 s of the 1.0 minute budget"):
        _loop_minutes(TrainOptions(minutes=1.0), 70.0, 10.0)


def test_drafts_of_one_target_share_its_answers(tiny, tmp_path, monkeypatch):
    """With an answers cache the target generates once; the next draft trains on the same
    sequences, loaded from the file."""
    import drafts.train as train_module

    target, engine, prompts, _ = tiny
    calls = []
    real = train_module.self_distill

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "self_distill", counting)
    cache = str(tmp_path / "answers.pt")
    kw = dict(engine=engine, answers_cache=cache, max_new_tokens=GREEDY["max_new_tokens"],
              max_steps=2, minutes=10, draft_vocab_size=96, ttt_steps=2, show_progress=False)
    logs = []
    for algorithm in ("EAGLE", "NEXTN"):
        out = train_draft(algorithm, target, prompts, str(tmp_path / algorithm), **kw)
        logs.append(json.loads((tmp_path / algorithm / "train_log.json").read_text()))
        assert out == str(tmp_path / algorithm)
    assert len(calls) == 1
    assert logs[0]["answer_tokens"] == logs[1]["answer_tokens"] > 0


def test_a_draft_after_cached_answers_builds_no_generation_engine(tiny, tmp_path, monkeypatch):
    """Once the answers are cached, a later draft's engine only lends its model to the
    features (FEATURES_ONLY: no graphs, a small KV cache) and generates nothing."""
    import drafts.train as train_module

    target, engine, prompts, _ = tiny
    kw = dict(answers_cache=str(tmp_path / "answers.pt"), max_steps=2, minutes=10,
              max_new_tokens=GREEDY["max_new_tokens"], draft_vocab_size=96, ttt_steps=2,
              show_progress=False)
    train_draft("EAGLE", target, prompts, str(tmp_path / "first"), engine=engine, **kw)
    made, real = [], train_module._make_engine

    def making(target, o, **overrides):
        made.append(overrides)
        return real(target, o, skip_tokenizer_init=True, **overrides)  # the tiny target has none

    monkeypatch.setattr(train_module, "_make_engine", making)
    monkeypatch.setattr(train_module, "self_distill",
                        lambda *a, **k: pytest.fail("the cached answers were generated again"))
    train_draft("NEXTN", target, prompts, str(tmp_path / "second"), **kw)
    assert made == [train_module.FEATURES_ONLY]
    assert (tmp_path / "second" / "train_log.json").is_file()


def test_a_bad_data_spec_fails_before_the_engine_loads(monkeypatch, tmp_path):
    import drafts.train as train_module

    monkeypatch.setattr(train_module, "_make_engine",
                        lambda *a, **k: pytest.fail("an engine was built for bad data"))
    with pytest.raises(ValueError, match="'nosuch'"):
        train_draft("EAGLE", None, "sharegpt:0.5,nosuch:0.5", str(tmp_path / "d"))


def test_draft_cache_keys_follow_content_not_paths(tmp_path):
    """A checkout moved elsewhere (or a cache copied to another machine) keeps its drafts; an
    edited data file or a changed option does not."""
    import shutil

    from drafts.train import TrainOptions, cache_key
    from specpcg.gsm8k import DATA_DIR

    DEFAULT_DATA = str(DATA_DIR / "train.jsonl")

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    moved = [shutil.copy(DEFAULT_DATA, tmp_path / d / "train.jsonl") for d in ("a", "b")]
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "config.json").write_text('{"hidden_size": 8}')
    o = TrainOptions()
    key = cache_key("EAGLE", str(target), DEFAULT_DATA, o)
    assert cache_key("EAGLE", str(target), str(moved[0]), o) == key
    assert cache_key("EAGLE", str(target), str(moved[1]), o) == key
    with open(moved[1], "a", encoding="utf-8") as f:
        f.write('{"question": "1 + 1?", "answer": "#### 2"}\n')
    assert cache_key("EAGLE", str(target), str(moved[1]), o) != key
    assert cache_key("EAGLE", str(target), DEFAULT_DATA, TrainOptions(ttt_steps=3)) != key
    assert cache_key("EAGLE", str(target), DEFAULT_DATA + ":0.5,gsm8k:0.5", o) != key
    assert cache_key("NEXTN", str(target), DEFAULT_DATA, o) != key
    (target / "config.json").write_text('{"hidden_size": 16}')
    assert cache_key("EAGLE", str(target), DEFAULT_DATA, o) != key
    assert cache_key("EAGLE", "shape:llama-3-8b", DEFAULT_DATA, o)["target"] == {
        "name": "shape:llama-3-8b"}


def _plain_soft_ce(h, w, y, ids=None, probs=None):
    """The loss as autograd would take it over whole [rows, vocab] logits."""
    import torch.nn.functional as F

    logits = F.linear(h, w.to(h.dtype))  # float64 here: exact enough to compare against
    if ids is None:
        return F.cross_entropy(logits, y, ignore_index=-1, reduction="sum")
    picked = torch.log_softmax(logits, -1).gather(1, ids.clamp(min=0))
    return -(probs * picked)[y >= 0].sum()


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("trainable", [False, True])
@pytest.mark.parametrize("chunk_rows", [7, 64])
def test_the_chunked_soft_loss_has_the_plain_loss_and_gradient(soft, trainable, chunk_rows):
    """head_loss takes the gradient with the loss, chunk by chunk (drafts.soft_ce); loss and
    gradients must match autograd over whole logits, with rows without a label, soft ids
    outside the vocabulary, a frozen weight and chunks that do not divide the rows."""
    from drafts.soft_ce import soft_cross_entropy

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=gen, dtype=torch.float64).requires_grad_(trainable)
    h = torch.randn(30, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(-1, 50, (30,), generator=gen)
    soft_args = ()
    if soft:
        ids = torch.randint(-1, 50, (30, 4), generator=gen)
        ids[:, 0] = y
        probs = torch.softmax(torch.randn(30, 4, generator=gen, dtype=torch.float64), -1)
        soft_args = (ids, probs.masked_fill(ids < 0, 0.0))
    wrt = [h, w] if trainable else [h]
    plain = _plain_soft_ce(h, w, y, *soft_args)
    got = soft_cross_entropy(h, w, y, *soft_args, chunk_rows=chunk_rows)
    torch.testing.assert_close(got, plain)
    for a, b in zip(torch.autograd.grad(2.5 * got, wrt), torch.autograd.grad(2.5 * plain, wrt)):
        torch.testing.assert_close(a, b)


def test_vocab_coverage_counts_answer_labels_inside_the_draft_vocabulary():
    from drafts.train_data import Features
    from drafts.train_heads import vocab_coverage

    # Two sequences: prompt lengths 2 and 3; answer labels start at prompt_len - 1.
    labels = torch.tensor([9, 1, 2, 3, 9, 9, 4, 5, 6])
    feats = Features(token_ids=torch.zeros(9, dtype=torch.long), labels=labels, hidden=None,
                     offsets=[0, 4, 9], prompt_lens=[2, 3])
    t2d = torch.full((10,), -1)
    t2d[torch.tensor([1, 2, 4, 9])] = torch.arange(4)
    # answer labels: seq 0 -> [1, 2, 3] (2 inside), seq 1 -> [4, 5, 6] (1 inside)
    assert vocab_coverage(feats, [0], t2d) == pytest.approx(2 / 3)
    assert vocab_coverage(feats, [0, 1], t2d) == pytest.approx(3 / 6)


def test_soft_labels_keep_the_draft_vocabulary_and_renormalise():
    from drafts.train_data import Features
    from drafts.train_heads import _soft_labels

    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]))
    feats = Features(token_ids=torch.zeros(2, dtype=torch.long), labels=torch.tensor([7, 3]),
                     hidden=None, offsets=[0, 2], prompt_lens=[1],
                     soft_ids=torch.tensor([[7, 2, 5], [3, 8, 9]]), soft_logp=logp.half())
    t2d = torch.full((10,), -1)
    t2d[torch.tensor([2, 3, 7])] = torch.arange(3)  # ids 5, 8 and 9 lie outside
    got = _soft_labels(feats, torch.tensor([0, 1]), t2d, CPU)
    assert got["soft_ids"].tolist() == [[2, 0, -1], [1, -1, -1]]
    torch.testing.assert_close(got["soft_probs"], torch.tensor([[0.625, 0.375, 0.0],
                                                                [1.0, 0.0, 0.0]]),
                               atol=2e-3, rtol=0)


def test_one_hot_soft_labels_give_the_hard_loss_and_spread_ones_differ():
    import torch.nn.functional as F

    from drafts.soft_ce import soft_cross_entropy

    w = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    h = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([3, -1, 0, 19, 7, 7])
    hard = soft_cross_entropy(h, w, y)
    ids = torch.stack([y, torch.full_like(y, 5)], dim=1)
    one_hot = torch.tensor([[1.0, 0.0]]).expand(6, 2)
    assert torch.allclose(soft_cross_entropy(h, w, y, ids, one_hot), hard)
    assert torch.allclose(hard, F.cross_entropy(h @ w.T, y, ignore_index=-1, reduction="sum"))
    spread = torch.tensor([[0.5, 0.5]]).expand(6, 2)
    assert not torch.allclose(soft_cross_entropy(h, w, y, ids, spread), hard)


def test_features_carry_the_targets_top_k_with_the_label_first():
    from drafts.train_data import Sequences, extract_features

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=H, num_kv_heads=HKV, head_dim=D, max_position_embeddings=64)
    model = build_model(cfg, None, CPU, torch.float32, seed=3)
    seqs = Sequences(token_ids=[[1, 5, 9, 2], [3, 4, 8, 8, 1, 7]], prompt_lens=[2, 3])
    feats = extract_features(model, seqs, (), False, CPU, show_progress=False, soft_k=4)
    assert feats.soft_ids.shape == (10, 4) and feats.soft_logp.shape == (10, 4)
    assert torch.equal(feats.soft_ids[:, 0], feats.labels)
    probs = feats.soft_logp.float().exp()
    assert (probs[:, :-1] >= probs[:, 1:]).all() and (probs.sum(-1) <= 1.001).all()
    assert extract_features(model, seqs, (), False, CPU, show_progress=False).soft_ids is None


def test_the_held_out_split_keeps_each_group_on_one_side():
    from drafts.train_data import heldout_split as _split

    groups = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5]
    for seed in range(5):
        split = _split(len(groups), 0.3, seed, groups)
        held, train = set(split["heldout"]), set(split["train"])
        assert held and train and held | train == set(range(10)) and not held & train
        assert not {groups[i] for i in held} & {groups[i] for i in train}
    # Without groups every sequence is its own: exactly the fraction asked for.
    assert len(_split(20, 0.25, 0)["heldout"]) == 5


def test_offline_figures_report_a_chats_later_turns_apart():
    from drafts.train_data import source_labels as _source_labels
    from drafts.train_data import Sequences

    seqs = Sequences([[1, 2], [1, 2, 3], [4, 5]], [1, 2, 1], ["sharegpt", "sharegpt", "gsm8k"],
                     [0, 0, 1], [0, 1, 0])
    assert _source_labels(seqs) == ["sharegpt", "sharegpt turn 2+", "gsm8k"]
    assert _source_labels(Sequences([[1, 2]], [1])) == ["ids"]



@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN"])
def test_an_fp32_head_reads_a_bf16_targets_embeddings(algorithm):
    """On a GPU the target runs in bf16 while its head trains in fp32, reading the target's
    embeddings: the head's forward takes them (EAGLE3's norms once wrote their fp32 outputs
    into a buffer of the embeddings' dtype, a ValueError once the target's answers had been
    generated), and gives the fp32 head's outputs up to the bf16 rounding of a norm."""
    from specpcg.attention.dense import DenseAttnBackend, dense_batch, dense_forward

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=H, num_kv_heads=HKV, head_dim=D, max_position_embeddings=64)
    target = build_model(cfg, None, CPU, torch.float32, seed=3)
    embed = target.model.embed_tokens.weight
    with torch.no_grad():  # values a bf16 target holds exactly
        embed.copy_(embed.bfloat16().float())
    head, _ = random_head(algorithm, cfg, CPU, torch.float32, seed=1)
    head.attach_target(target)
    backend = DenseAttnBackend(H, HKV, D, D ** -0.5, None, "mask")
    ids = torch.tensor([5, 9, 2, 7, 11, 3])
    width = head.fc.in_features if algorithm == "EAGLE3" else cfg.hidden_size
    hidden = torch.randn(len(ids), width, generator=torch.Generator().manual_seed(0))

    def run():
        x = head.project_target_hidden(hidden)
        return dense_forward(head, backend, dense_batch(ids, [len(ids)]), (), input_hidden=x)[0]

    with torch.no_grad():
        want = run()
        target.to(torch.bfloat16)
        got = run()
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    assert want.abs().max() > 0.1
