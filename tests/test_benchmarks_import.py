"""Every script under benchmarks/ imports: a name one of them takes from another (or from
common) that was moved or renamed breaks here, not first on a GPU machine."""

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_a_benchmark_script_imports(name):
    module = importlib.import_module(name)
    assert module.__file__ == str(BENCHMARKS / f"{name}.py")
