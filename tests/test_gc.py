"""The engine freezes what startup leaves alive out of the garbage collector's walks, and lets
it go again at shutdown (CPU, tiny model)."""

import gc
import weakref

import pytest

from tests.tiny_models import tiny_engine


@pytest.mark.parametrize("algo", [None, "NGRAM"])
def test_startup_objects_are_frozen_and_shutdown_lets_the_model_go(tiny_path, algo):
    """With a draft too: its context holds the target and the KV cache, which a next engine in
    the same process needs the memory of."""
    engine = tiny_engine(tiny_path, speculative_algorithm=algo)
    assert gc.get_freeze_count() > 1000  # the libraries, the model: walked by no collection
    model, kv_cache = weakref.ref(engine.model), weakref.ref(engine.kv_cache)
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4,
                                                                "temperature": 0})
    assert len(out["output_ids"]) == 4
    engine.shutdown()
    assert gc.get_freeze_count() == 0
    assert model() is None  # frozen objects are never collected: shutdown unfroze them first
    assert kv_cache() is None
