"""The engine freezes what startup leaves alive out of the garbage collector's walks, and lets
it go again at shutdown (CPU, tiny model)."""

import gc
import weakref

from tests.tiny_models import tiny_engine


def test_startup_objects_are_frozen_and_shutdown_lets_the_model_go(tiny_path):
    engine = tiny_engine(tiny_path)
    assert gc.get_freeze_count() > 1000  # the libraries, the model: walked by no collection
    model = weakref.ref(engine.model)
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4,
                                                                "temperature": 0})
    assert len(out["output_ids"]) == 4
    engine.shutdown()
    assert gc.get_freeze_count() == 0
    assert model() is None  # frozen objects are never collected: shutdown unfroze them first
