"""Adaptive speculation's finish estimate replayed over a pinned speculative run: how the batch's
end it predicts compares with the end the run reached.

With nothing waiting the adaptive engine compares the time to finish the running batch on each
side (specpcg/speculative/finish.py): plain steps take the most tokens any request has left;
speculative ones take each request's tokens left over its accept length, measured on its last
shadow verifies, and the batch ends with its slowest request. This probe runs one batch pinned to
speculation, logs every request's verifies in order (tokens each emitted), then at every
--every-th step replays the estimate as the engine builds it (`Finish.of` over each running
request's last shadow verifies, shrunk toward priors: finished requests' accept lengths, else
the batch's pooled one) and prices both sides with --spec-ms / --plain-ms per batch-size bucket,
as `finish_seconds` does. Three estimates, by their priors: a later batch's (`est_spec_s`: the
same prompts ran before it, as in bench_alone.py), a first batch's (`est_first_batch_s`: the
requests finished so far) and none (`est_no_priors_s`). Beside them: the speculative side's true
time, the same pricing over the steps each request then really took. A line per replayed step;
the summary counts, per estimate, the steps where it would have run plain steps that the run
shows slower (`missed`), the reverse (`wrong_spec`), and the time its side lost (`lost`). The
replay leaves out a switch's cost.

    python benchmarks/probe_straggler.py [--model-path GGUF] [--algorithm NGRAM] [--batch 64]
        [--max-new-tokens 256] [--setting 7,1,8] [--spec-ms 1=0.605 ... 64=1.595]
        [--plain-ms 1=0.48 ... 64=1.399] [--out FILE] [--plot-only FILE]

The default step times are one H100's (the default model, NGRAM (7, 1, 8), chat prompts, bucket
by bucket, 0cc170d: docs/PERFORMANCE.md, "Shadow-priced choices that follow an answer").
"""

from __future__ import annotations

import argparse
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import common

common.add_repo_to_path()

from bench_adaptive import engine_kwargs, prompts_for  # noqa: E402
from specpcg.speculative.bucket import bucket_of  # noqa: E402
from specpcg.speculative.finish import (KEPT_ACCEPTS, MIN_ACCEPTS, Finish,  # noqa: E402
                                        finish_seconds, finished_accept)
from specpcg.speculative.shadow import RECENT, accept_length  # noqa: E402

H100_SPEC_MS = {1: 0.605, 2: 0.873, 4: 0.88, 8: 0.934, 16: 0.977, 64: 1.595}
H100_PLAIN_MS = {1: 0.48, 2: 0.597, 4: 0.62, 8: 0.68, 16: 0.886, 64: 1.399}


def record_verifies(engine) -> dict:
    """Wraps the scheduler's append: {request id: [(call index, tokens), ...]} in call order,
    a request's first entry its prefill's token."""
    s, log, calls = engine.scheduler, {}, [0]
    append = s._append_and_finish

    def logged(reqs, new_tokens):
        calls[0] += 1
        for req, tokens in zip(reqs, new_tokens):
            log.setdefault(req.rid, []).append((calls[0], len(tokens)))
        return append(reqs, new_tokens)

    s._append_and_finish = logged
    return log


def step_ms(table: dict):
    """step_s(batch size) from per-bucket milliseconds: the size's bucket, else the nearest
    larger one measured."""
    keys = sorted(table)

    def at(size: int) -> float:
        key = bucket_of(size)
        return table[next((k for k in keys if k >= key), keys[-1])] / 1e3
    return at


def whole_accepts(timelines: dict, call: int) -> list:
    """The accept lengths the requests finished by scheduler call `call` teach the finish
    estimate's priors (`finished_accept` over all their verifies, as a speculating engine's
    requests carry them)."""
    out = []
    for entries in timelines.values():
        if entries[-1][0] <= call:
            tokens = [n for _, n in entries[1:]]
            req = SimpleNamespace(spec_verify_ct=len(tokens), shadow_verifies=0,
                                  spec_accepted_drafts=sum(tokens) - len(tokens))
            if (accept := finished_accept(req)) is not None:
                out.append(accept)
    return out


def replay_at(timelines: dict, call: int, max_new: int, spec_s, plain_s, warm: list) -> dict:
    """The estimate at scheduler call `call` (after it) against the run's own end: the running
    requests' verifies so far stand in for their shadow verifies (`Finish.of` and
    `accept_length` read them as the engine's requests carry them). Three sets of priors: an
    engine's first batch (the requests finished by then), a later one's (`warm`, a batch of the
    same prompts before it, then those), and none (the running batch's pooled accept length)."""
    reqs, rem, true_steps = [], [], []
    for entries in timelines.values():
        done = [n for c, n in entries if c <= call]
        produced = sum(done)
        if produced >= max_new or len(done) == len(entries):
            continue  # finished by this call
        recent = deque(done[1:], maxlen=RECENT)  # its verifies (the first: its prefill's token)
        reqs.append(SimpleNamespace(shadow_recent=recent, shadow_tokens=sum(recent),
                                    spec_verify_ct=0, spec_accepted_drafts=0))
        rem.append(max_new - produced)
        true_steps.append(len(entries) - len(done))
    if not reqs:
        return {}
    est = Finish.of(reqs, tuple(rem))
    pooled = accept_length(reqs) or 1.0
    first = whole_accepts(timelines, call)
    priors = {"est_spec_s": (warm + first)[-KEPT_ACCEPTS:], "est_first_batch_s": first,
              "est_no_priors_s": []}
    return {"call": call, "running": len(reqs), "pooled_accept": round(pooled, 3),
            "least_accept": round(min(t / v if v else pooled
                                      for t, v in zip(est.spec_tokens, est.verifies)), 3),
            **{key: finish_seconds(est.spec_steps_each(
                pooled, accepts if len(accepts) >= MIN_ACCEPTS else ()), spec_s)
               for key, accepts in priors.items()},
            "true_spec_s": finish_seconds(true_steps, spec_s),
            "plain_s": finish_seconds(rem, plain_s)}


ESTIMATES = {"est_spec_s": "speculative, estimated",
             "est_first_batch_s": "estimated in a first batch",
             "est_no_priors_s": "estimated without priors"}


def summary(lines: list, margin: float) -> dict:
    """Per estimate, the replayed steps where its side and the run's faster side differ by more
    than `margin` (missed: it says plain, speculation was faster; wrong_spec: the reverse), and
    `lost`: the time its side takes beyond the faster side's, over the faster side's, averaged
    over the replayed steps."""
    out = {"probe": "straggler_summary", "replayed": len(lines), "margin": margin}
    for key in ESTIMATES:
        name = key[:-2]
        spec = [x[key] < x["plain_s"] for x in lines]
        out[f"{name}_missed"] = sum(not s and x["true_spec_s"] * (1 + margin) < x["plain_s"]
                                    for s, x in zip(spec, lines))
        out[f"{name}_wrong_spec"] = sum(s and x["plain_s"] * (1 + margin) < x["true_spec_s"]
                                        for s, x in zip(spec, lines))
        lost = [(x["true_spec_s"] if s else x["plain_s"]) / min(x["true_spec_s"], x["plain_s"])
                - 1 for s, x in zip(spec, lines)]
        out[f"{name}_lost"] = round(sum(lost) / len(lost), 4) if lost else None
        ratios = sorted(x[key] / x["true_spec_s"] for x in lines if x["true_spec_s"] > 0)
        out[f"{name}_over_true_median"] = round(ratios[len(ratios) // 2], 3) if ratios else None
    return out


def plot(lines: list, path) -> None:
    """Each side's seconds to finish the batch, by the step they were priced at."""
    series = {**ESTIMATES, "true_spec_s": "speculative, as run", "plain_s": "plain"}
    panel = {"title": "time to finish the running batch", "xlabel": "scheduler call",
             "ylabel": "ms", "series": {name: [(x["call"], x[key] * 1e3) for x in lines]
                                        for key, name in series.items() if key in lines[0]}}
    first = lines[0]
    common.line_plot([panel], path, f"{first['algorithm']} ({first['setting']}), batch "
                     f"{first['batch']}, {first['device']}, {first['git']}")


def parse_ms(items: list, default: dict) -> dict:
    return {int(k): float(v) for k, v in (i.split("=") for i in items)} if items else default


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--algorithm", default="NGRAM")
    p.add_argument("--setting", default="7,1,8")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128, help="without a tokenizer")
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--spec-ms", nargs="*", default=[])
    p.add_argument("--plain-ms", nargs="*", default=[])
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--out", default=None, help="JSON lines; a plot beside them (.png)")
    p.add_argument("--plot-only", default=None, metavar="FILE",
                   help="plot FILE's lines, measuring nothing")
    return p.parse_args(argv)


def run(a: argparse.Namespace, engine_args: dict = None) -> list:
    """The replayed lines and the summary line (also printed, and written to --out)."""
    from specpcg import Engine

    engine = Engine(model_path=a.model_path, max_running_requests=a.batch, show_progress=False,
                    **engine_kwargs("pinned", a.algorithm, None, common.parse_setting(a.setting)),
                    **(engine_args or {}))
    timelines = record_verifies(engine)
    params = {"max_new_tokens": a.max_new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompts_for(engine, a.batch, a.prompt_len), sampling_params=params)
    spec_s = step_ms(parse_ms(a.spec_ms, H100_SPEC_MS))
    plain_s = step_ms(parse_ms(a.plain_ms, H100_PLAIN_MS))
    last = max(c for entries in timelines.values() for c, _ in entries)
    warm = whole_accepts(timelines, last)
    lines = [x for c in range(1, last, a.every)
             if (x := replay_at(timelines, c, a.max_new_tokens, spec_s, plain_s, warm))]
    meta = {"probe": "straggler", "algorithm": a.algorithm, "batch": a.batch,
            "setting": a.setting, **common.machine_info(engine.device)}
    out = [{**meta, **x} for x in lines] + [{**meta, **summary(lines, a.margin)}]
    for line in out:
        common.emit_line(line, a.out)
    if a.out:
        plot(out[:-1], Path(a.out).with_suffix(".png"))
    return out


if __name__ == "__main__":
    args = parse()
    if args.plot_only:
        lines = [x for x in common.read_jsonl(args.plot_only) if x["probe"] == "straggler"]
        plot(lines, Path(args.plot_only).with_suffix(".png"))
    else:
        run(args)
