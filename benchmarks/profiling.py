"""One call under cProfile, its heaviest functions as rows a probe can print and keep.

Two engines profiled alike show where one spends host time the other does not: rows by self
time name the function that does the work, rows by cumulative time the path that calls it.
cProfile slows Python several times over, so its seconds compare engines, never a step's real
cost.
"""

from __future__ import annotations

import cProfile
import pstats
import re

OURS = re.compile(r"(specpcg|drafts|kernels)/(?!models/)")  # the engine's code, not a model's


def profile_rows(fn, top: int, sort: str = "tottime", only=OURS) -> list:
    """Runs fn() under cProfile; returns its `top` functions by `sort` ("tottime": self time,
    or "cumtime") whose file matches `only` (None: every function), as dicts: name (file:line
    function), calls, self_s, cum_s."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    rows = [{"name": f"{_short(f)}:{line} {name}", "calls": nc, "self_s": round(tt, 5),
             "cum_s": round(ct, 5)}
            for (f, line, name), (_, nc, tt, ct, _) in stats.items()
            if only is None or only.search(f)]
    key = "self_s" if sort == "tottime" else "cum_s"
    return sorted(rows, key=lambda r: -r[key])[:top]


def _short(path: str) -> str:
    """A file's path from the repository's top folders on (the whole path elsewhere)."""
    m = re.search(r"(specpcg|drafts|kernels|benchmarks)/.*", path)
    return m.group(0) if m else path


def print_rows(title: str, rows: list) -> None:
    print(f"\n{title}")
    print(f"{'calls':>8} {'self s':>9} {'cum s':>9}  function")
    for r in rows:
        print(f"{r['calls']:8d} {r['self_s']:9.4f} {r['cum_s']:9.4f}  {r['name']}")
