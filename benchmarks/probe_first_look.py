"""A batch of one's looks from plain steps into speculation, the first against the next: each
piece of the draft's catch-up timed between device syncs, and the switch costs the adaptive
controller kept (the first of them prices every later look: speculative/switches.py).

Looks are scripted (`probe_switch.script_choices`: --spec speculative steps after every
--plain plain ones). With --cold the start-up warm-ups this probe is about are off: the
hidden ring's first read (`HiddenRing.warm`) and each graph's first replay
(`breakable.REPLAY_ON_CAPTURE`). One JSON line per generate.

    python benchmarks/probe_first_look.py --model-path shape:smollm2-135m --untrained \
        [--algorithm EAGLE3] [--plain 32] [--spec 3] [--rounds 3] [--cold] [--out FILE]
"""

from __future__ import annotations

import argparse

import common
from bench_adaptive import add_probe_args, probe_engine, prompts_for
from probe_switch import script_choices, wrap

common.add_repo_to_path()

SHOWN = 4  # calls of each piece a line shows


def timed_pieces(engine, log: list) -> None:
    """Logs (piece, ms) of every call of the catch-up's pieces."""
    import torch

    import drafts.eagle as eagle
    import drafts.resume as resume
    from specpcg.graphs.draft_runner import DraftGraphRunner
    from specpcg.hidden_ring import HiddenRing

    draft = engine.scheduler.spec.draft
    pieces = [(draft, "catch_up_to_paths", "catch_up"), (draft, "_eager_catch_up", "eager"),
              (eagle, "gather_rows", "gather"), (HiddenRing, "read", "ring_read"),
              (resume, "_replay", "replay"), (resume, "_pack", "pack"),
              (DraftGraphRunner, "catch_up", "graph_replay"),
              (DraftGraphRunner, "load_on_device", "load")]
    for obj, name, tag in pieces:
        if hasattr(obj, name):
            wrap(obj, name, log, lambda s, t=tag: (t, round(1e3 * s, 3)),
                 sync=torch.cuda.synchronize if torch.cuda.is_available() else None)


def split_first_read(log: list) -> None:
    """The hidden ring's first read in the process, op by op between device syncs (its
    pieces logged as read:<op>), through HiddenRing.read's own steps; later reads as they are."""
    import time

    import torch

    from specpcg.hidden_ring import HiddenRing
    from specpcg.transfer import to_device

    plain_read, first = HiddenRing.read, [True]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def read(ring, pool_rows, first_pos, steps):
        if not first[0]:
            return plain_read(ring, pool_rows, first_pos, steps)
        first[0] = False
        ops = [("to_device", lambda _: to_device([[r * ring.depth for r in pool_rows],
                                                   first_pos], ring.buf.device)),
               ("arange", lambda start: (start, torch.arange(steps, device=ring.buf.device))),
               ("index", lambda a: a[0][0, :, None] + (a[0][1, :, None] + a[1]) % ring.depth),
               ("index_select", lambda index: ring.buf.view(-1, ring.width).index_select(
                   0, index.view(-1)))]
        value = None
        for name, op in ops:
            sync()
            t0 = time.perf_counter()
            value = op(value)
            sync()
            log.append((f"read:{name}", round(1e3 * (time.perf_counter() - t0), 3)))
        return value.view(len(pool_rows), steps, ring.width)
    HiddenRing.read = read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(p)
    p.add_argument("--plain", type=int, default=32)
    p.add_argument("--spec", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--cold", action="store_true", help="start-up warm-ups off")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    log = []
    if args.cold:
        from specpcg.graphs import breakable
        from specpcg.hidden_ring import HiddenRing

        breakable.REPLAY_ON_CAPTURE = False
        HiddenRing.warm = lambda self: None
        split_first_read(log)
    engine, _ = probe_engine(args, "adaptive", 1)
    script_choices(engine, args.plain, args.spec)
    timed_pieces(engine, log)
    prompts = prompts_for(engine, 1, 128)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    switches = engine.scheduler.adaptive._switches
    for i in range(args.rounds):
        log.clear()
        engine.generate(input_ids=prompts, sampling_params=params)
        line = {"probe": "first_look", "round": i, "cold": args.cold,
                "pieces_ms": {t: [ms for tag, ms in log if tag == t][:SHOWN] for t in dict(log)},
                "switch_ms": {side: [round(1e3 * s, 3) for s, _ in list(kept)[:SHOWN]]
                              for side, kept in switches.kept.items()},
                **common.machine_info(engine.device)}
        common.emit_line(line, args.out)


if __name__ == "__main__":
    main()
