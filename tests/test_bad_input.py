"""Bad input gets a ValueError naming the field and value; list calls are refused whole."""

import pytest

from specpcg import Engine
from tests.tiny_models import save_tiny_checkpoint

OK = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bad")
    save_tiny_checkpoint("llama", path)
    return Engine(model_path=str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                  max_total_tokens=512, context_length=64)


BAD_PARAMS = [
    ({"max_new_tokens": -1}, r"max_new_tokens.*-1"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens.*2\.5"),
    ({"max_new_tokens": "8"}, r"max_new_tokens.*'8'"),
    ({"temperature": -0.1}, r"temperature.*-0\.1"),
    ({"top_p": 0.0}, r"top_p.*0\.0"),
    ({"top_p": 1.5}, r"top_p.*1\.5"),
    ({"top_k": 0}, r"top_k.*0"),
    ({"top_k": -2}, r"top_k.*-2"),
    ({"min_p": 2}, r"min_p.*2"),
    ({"temprature": 1}, r"unknown field.*temprature"),
]


@pytest.mark.parametrize("params,pattern", BAD_PARAMS)
def test_bad_sampling_params(engine, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        engine.generate(input_ids=[1, 2, 3], sampling_params=params)


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[], sampling_params=OK)


def test_prompt_longer_than_context(engine):
    with pytest.raises(ValueError, match="prompt has 80 tokens but context_length is 64"):
        engine.generate(input_ids=[1] * 80, sampling_params=OK)


def test_token_outside_vocab(engine):
    with pytest.raises(ValueError, match="token id 999"):
        engine.generate(input_ids=[1, 999], sampling_params=OK)


def test_list_call_refused_whole_naming_index(engine):
    free_before = engine.get_server_info()["kv_cache"]["free_slots"]
    with pytest.raises(ValueError,
                       match=r"input 2: temperature must be a finite number >= 0, got -1"):
        engine.generate(input_ids=[[1, 2], [3, 4], [5, 6]],
                        sampling_params=[OK, OK, {**OK, "temperature": -1}])
    assert not engine.scheduler.has_work()  # nothing was queued
    assert engine.get_server_info()["kv_cache"]["free_slots"] == free_before
    out = engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params=OK)  # still usable
    assert [o["meta_info"]["completion_tokens"] for o in out] == [4, 4]


def test_sampling_params_list_length_mismatch(engine):
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 inputs"):
        engine.generate(input_ids=[[1], [2]], sampling_params=[OK])


def test_unknown_speculative_algorithm():
    with pytest.raises(ValueError, match=r"speculative_algorithm 'MEDUSA' is unknown"):
        Engine(speculative_algorithm="MEDUSA")


@pytest.mark.parametrize("kwargs,pattern", [
    ({"attention_backend": "cudnn"}, r"attention_backend 'cudnn'"),
    ({"max_running_requests": 0}, r"max_running_requests.*0"),
    ({"dtype": "int3"}, r"dtype 'int3'"),
    ({"bogus": 1}, r"unknown Engine argument.*bogus"),
])
def test_bad_engine_args(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Engine(**kwargs)


def test_missing_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="model_path.*nope"):
        Engine(model_path=missing)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ValueError, match="model_path.*broken.gguf"):
        Engine(model_path=str(bad))


def test_tree_on_a_backend_without_tree_masks(tmp_path, monkeypatch):
    """A draft tree on a backend that cannot attend under a tree mask is refused at startup,
    naming the topk and the backend."""
    from specpcg.attention.torch_backend import TorchAttnBackend
    from tests.tiny_models import tiny_engine

    save_tiny_checkpoint("llama", tmp_path)
    monkeypatch.setattr(TorchAttnBackend, "supports_tree_mask", False)
    with pytest.raises(ValueError, match=r"speculative_eagle_topk=3 .*'torch' cannot attend"):
        tiny_engine(str(tmp_path), attention_backend="torch", speculative_algorithm="NGRAM",
                    speculative_eagle_topk=3, speculative_num_steps=3,
                    speculative_num_draft_tokens=6)
