"""On CUDA a steady decode or speculative step never makes the host wait for the device, except
through the one read a step makes of its tokens (an event on a pinned copy,
`specpcg.transfer.HostCopy`, which CUDA's sync check does not count): the check is set to raise
while the engine runs steps of requests already decoding. A wait anywhere else (a pageable copy,
`.item()`, `.tolist()` of a device tensor, a mask's `nonzero()`) would leave the GPU idle while
the host prepares the next step.

An EAGLE3 engine (a random head: what is checked is the host's waits, not what it accepts) runs
its chain pinned, and its plain steps held (adaptive speculation choosing them at every step),
where the target's aux hidden states go to the draft each step."""

import sys
from pathlib import Path

import pytest
import torch

from specpcg import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.cuda

SYSTEMS = {
    "none": {},
    "NGRAM chain": dict(speculative_algorithm="NGRAM", speculative_num_steps=7,
                        speculative_eagle_topk=1, speculative_num_draft_tokens=8),
    "NGRAM tree": dict(speculative_algorithm="NGRAM", speculative_num_steps=5,
                       speculative_eagle_topk=4, speculative_num_draft_tokens=8),
    "EAGLE3 chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3,
                         speculative_eagle_topk=1, speculative_num_draft_tokens=4),
    "EAGLE3 plain steps": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3,
                               speculative_eagle_topk=1, speculative_num_draft_tokens=4),
}
HELD_PLAIN = ("EAGLE3 plain steps",)


@pytest.fixture(scope="module")
def eagle3_head() -> str:
    """A random EAGLE3 head for the default model, saved as a checkpoint (bench_step's)."""
    from bench_step import random_head_dir
    from specpcg.models.loader import default_model_path

    return random_head_dir("EAGLE3", default_model_path())


def build(system: str, request) -> Engine:
    from holds import plain_only

    kw = dict(SYSTEMS[system])
    held = system in HELD_PLAIN
    if kw.get("speculative_algorithm") == "EAGLE3":
        kw["speculative_draft_model_path"] = request.getfixturevalue("eagle3_head")
    engine = Engine(device="cuda", skip_tokenizer_init=True, max_running_requests=8,
                    disable_adaptive_speculation=not held, show_progress=False, **kw)
    if held:
        plain_only(engine)
    return engine


WARM_STEPS, CHECKED_STEPS = 8, 24


@pytest.mark.parametrize("system", SYSTEMS)
def test_steady_steps_never_wait_for_the_device(system, request):
    engine = build(system, request)
    gen = torch.Generator().manual_seed(0)
    # Repeated spans give NGRAM matches, so its verifies accept runs of drafts.
    base = torch.randint(100, 20000, (24,), generator=gen).tolist()
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    for i in range(4):
        engine.submit(input_ids=base * 3 + [100 + i], sampling_params=params)
    for _ in range(WARM_STEPS):  # the prefill, then steps until every request decodes
        assert not engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(CHECKED_STEPS):
            assert not engine.step(), "a request finished inside the checked steps"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 4 and all(len(o["output_ids"]) == 400 for o in outs)
    engine.shutdown()
