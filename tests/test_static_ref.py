"""The benchmarks' gpt-fast-style peer (benchmarks/static_ref.py) decodes the same greedy tokens
as the engine on the same weights (fp32, CPU, uncompiled): a ratio against it compares the same
work."""

import sys
from pathlib import Path

import torch

from specpcg import Engine
from test_train import _tiny_target

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_static_cache_decoder_matches_the_engine(tmp_path):
    from static_ref import StaticCacheDecoder

    torch.set_num_threads(1)
    engine = Engine(model_path=_tiny_target(tmp_path / "t"), skip_tokenizer_init=True,
                    device="cpu", dtype="float32", max_total_tokens=1024, show_progress=False)
    prompts = [[5, 9, 2, 7], [11, 3, 8, 1]]
    want = [o["output_ids"] for o in engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0})]
    ref = StaticCacheDecoder(engine.model, batch_size=2, max_len=64)
    tokens = ref.prefill(prompts).argmax(-1)
    got = [[t] for t in tokens.tolist()]
    for step in range(11):
        pos = torch.full((2,), 4 + step)
        tokens = ref(tokens, pos).argmax(-1)
        for g, t in zip(got, tokens.tolist()):
            g.append(t)
    assert got == want
