"""Where the host's time goes in an overlapped speculative step (cProfile, batch 1).

A warm engine with an EAGLE3 head (--draft DIR, or random weights with synthetic acceptance)
decodes chat prompts one at a time under cProfile; prints the functions with the most own time
per step and the cumulative time of the step's phases. With overlap the host's work, not the
device's, bounds a step when the two add up to more than the device time of the step's graphs.

    python benchmarks/probe_spec_overlap.py --draft DIR [--disable-overlap-schedule]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import common

common.add_repo_to_path()
from accept_prompts import chat_messages  # noqa: E402
from specpcg import Engine  # noqa: E402

PHASE_FILES = ("speculative/", "graphs/draft_runner.py", "graphs/decode_runner.py",
               "drafts/eagle.py", "drafts/round.py", "scheduler.py", "kv_cache.py",
               "triton_backend.py")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--draft", required=True)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    engine = Engine(model_path=args.model_path, speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=args.draft, show_progress=False,
                    disable_overlap_schedule=args.disable_overlap_schedule,
                    **common.PINNED_SPEC)
    params = {"max_new_tokens": 128, "temperature": 0}
    engine.generate(messages=chat_messages(1), sampling_params=params)  # warm-up
    prof = cProfile.Profile()
    verify0 = engine.get_server_info()["internal_states"][0].get("spec_verify_ct", 0)
    prof.enable()
    for msgs in chat_messages(args.num_prompts):
        engine.generate(messages=[msgs], sampling_params=params)
    prof.disable()
    steps = engine.get_server_info()["internal_states"][0]["spec_verify_ct"] - verify0
    stats = pstats.Stats(prof)
    print(f"steps {steps}; overlapped steps "
          f"{engine.get_server_info()['speculative']['overlapped_steps']}")
    own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
    phases = sorted(((k, v) for k, v in stats.stats.items() if any(
        f in k[0] for f in PHASE_FILES)), key=lambda kv: -kv[1][3])[:args.top]
    for title, rows in (("own time", own), ("the step's functions, cumulative", phases)):
        print(f"-- {title} (per step)")
        for (path, line, func), (_, calls, tottime, cumtime, _) in rows:
            print(f"{tottime / steps * 1e6:8.1f} us own {cumtime / steps * 1e6:8.1f} us cum "
                  f"{calls / steps:6.2f}/step  "
                  f"{path.split('/work/')[-1].split('site-packages/')[-1]}:{line}({func})")


if __name__ == "__main__":
    main()
