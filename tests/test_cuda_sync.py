"""On CUDA a steady decode or speculative step never makes the host wait for the device, except
through the one read a step makes of its tokens (an event on a pinned copy,
`specpcg.transfer.HostCopy`, which CUDA's sync check does not count): the check is set to raise
while the engine runs steps of requests already decoding. A wait anywhere else (a pageable copy,
`.item()`, `.tolist()` of a device tensor, a mask's `nonzero()`) would leave the GPU idle while
the host prepares the next step."""

import pytest
import torch

from specpcg import Engine

pytestmark = pytest.mark.cuda

SYSTEMS = {
    "none": {},
    "NGRAM chain": dict(speculative_algorithm="NGRAM", speculative_num_steps=7,
                        speculative_eagle_topk=1, speculative_num_draft_tokens=8),
    "NGRAM tree": dict(speculative_algorithm="NGRAM", speculative_num_steps=5,
                       speculative_eagle_topk=4, speculative_num_draft_tokens=8),
}
WARM_STEPS, CHECKED_STEPS = 8, 24


@pytest.mark.parametrize("system", SYSTEMS)
def test_steady_steps_never_wait_for_the_device(system):
    engine = Engine(device="cuda", skip_tokenizer_init=True, max_running_requests=8,
                    disable_adaptive_speculation=True, show_progress=False, **SYSTEMS[system])
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
