"""The GSM8K matrix in deterministic mode (`enable_deterministic_inference=True`): every
speculative algorithm x piecewise graphs on/off, 200 few-shot questions in one batch of 64
running requests, each cell against a no-spec run in the same mode and graph setting. Here no
near-tie is excused: every question's tokens must be identical, so the accuracy is too. The
other invariants are those of `test_gsm8k_matrix.py` (accept-length floors, piecewise hits
exactly when on, no KV leak). One JSON line per cell, with "deterministic": true, goes where the
matrix writes its lines."""

import pytest

from specpcg.gsm8k import build_prompts
from tests.matrix_common import (accept_length, append_record, first_divergence, run_gsm8k)
from tests.test_gsm8k_matrix import (GPU_ACCEPT_FLOORS, GPU_MAX_NEW_TOKENS, GPU_NUM_QUESTIONS,
                                     GPU_NUM_SHOTS, SPEC_ALGORITHMS, _check_graphs_and_kv,
                                     _gpu_engine, _gpu_record, checkpoints_once)  # noqa: F401

pytestmark = pytest.mark.cuda

CELLS = [(algo, pcg) for pcg in (True, False) for algo in SPEC_ALGORITHMS]


@pytest.fixture(scope="module")
def questions():
    return build_prompts(GPU_NUM_QUESTIONS, num_shots=GPU_NUM_SHOTS)


@pytest.fixture(scope="module")
def baselines(checkpoints_once, questions):  # noqa: F811
    """The deterministic no-spec run per PCG setting, built on first use."""
    runs = {}

    def get(pcg: bool):
        if pcg not in runs:
            engine = _gpu_engine(None, pcg, "triton", deterministic=True)
            try:
                runs[pcg] = run_gsm8k(engine, *questions, GPU_MAX_NEW_TOKENS)
            finally:
                engine.shutdown()
        return runs[pcg]
    return get


def identity_failures(run, base) -> tuple:
    """(identical count, messages for every question whose tokens differ)."""
    same, failures = 0, []
    for i, (got, want) in enumerate(zip(run.output_ids, base.output_ids)):
        k = first_divergence(got, want)
        if k is None:
            same += 1
        else:
            failures.append(f"question {i} diverges at token {k} of {len(got)} / {len(want)}")
    return same, failures


@pytest.mark.parametrize("algo,pcg", CELLS,
                         ids=[f"{a}-pcg_{'on' if p else 'off'}-deterministic" for a, p in CELLS])
def test_deterministic_gsm8k_cell(algo, pcg, questions, baselines):
    base = baselines(pcg)
    engine = _gpu_engine(algo, pcg, "triton", deterministic=True)
    try:
        run = run_gsm8k(engine, *questions, GPU_MAX_NEW_TOKENS)
        same, failures = identity_failures(run, base)
        if run.preds != base.preds:
            failures.append(f"accuracy {run.accuracy:.4f} against no-spec's {base.accuracy:.4f}")
        avg, floor = accept_length(run.info), GPU_ACCEPT_FLOORS[algo]
        if not avg >= floor:
            failures.append(f"avg accept length {avg:.3f} < floor {floor}")
        failures += _check_graphs_and_kv(engine, run, pcg)
        record = _gpu_record((algo, pcg, "triton", False), engine, run, base, same, 0.0, failures)
        record.update(deterministic=True, near_tie_ulps=0)
        path = append_record(record)
        print(f"{algo} pcg {'on' if pcg else 'off'} deterministic: identical "
              f"{same}/{len(base.output_ids)}, accuracy {run.accuracy:.3f} (no-spec "
              f"{base.accuracy:.3f}), avg accept length {avg:.2f}, {run.seconds:.1f} s -> {path}")
        assert not failures, "\n".join(failures[:20])
    finally:
        engine.shutdown()
