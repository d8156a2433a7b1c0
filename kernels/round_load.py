"""A draft round's integer inputs from device tensors (overlap scheduling): the catch-up's
tokens, positions and KV slots on the last verify's accepted path, the per-request segments and
the chain's slots, laid out as specpcg.graphs.draft_runner.DraftRoundBuffers reads them.

In torch that is about fifteen small kernels (aranges, wheres, two req_to_token gathers, a
concatenation), 30 us of every batch-1 speculative step on the H100
(benchmarks/results/step_eagle3_bs1_6412_b3898d0_h100.txt); the Triton kernel
(round_load_triton.py) is one program per request.
"""

from __future__ import annotations

import torch

from .dispatch import pick_triton, triton_module

SEGMENTS = ("rows", "seq_lens", "lens", "verify_rows", "roots")  # [n] each, after the [n, W]s


def round_inputs(rows, first_pos, lens, roots, ids, req_to_token, steps: int,
                 sink: int) -> dict:
    """The inputs by name (the twin's arithmetic): ids, positions, slots [n, W] (past a
    request's path: 0, 0 and the sink slot), the SEGMENTS [n], chain [steps, n]: the KV slots
    after the path, where the chain's steps write."""
    n, w = ids.shape
    cols = torch.arange(w, device=ids.device)
    real = cols < lens[:, None]  # [n, W]
    pos = torch.where(real, first_pos[:, None] + cols, 0)
    seq_lens = first_pos + lens
    values = {"ids": torch.where(real, ids, 0), "positions": pos,
              "slots": torch.where(real, req_to_token[rows[:, None], pos].long(), sink),
              "rows": rows, "seq_lens": seq_lens, "lens": lens,
              "verify_rows": torch.arange(n, device=ids.device), "roots": roots}
    if steps:
        offsets = torch.arange(steps, device=ids.device)[:, None]
        values["chain"] = req_to_token[rows[None, :], seq_lens[None, :] + offsets]
    return values


def load_round(rows: torch.Tensor, first_pos: torch.Tensor, lens: torch.Tensor,
               roots: torch.Tensor, ids: torch.Tensor, req_to_token: torch.Tensor, steps: int,
               sink: int, out: torch.Tensor, use_triton: bool | None = None) -> None:
    """rows, first_pos, lens, roots [n]; ids [n, W]: n requests' paths (DevicePath's fields).
    Writes round_inputs' values into out (int64, n * (3W + 5 + steps) entries): ids,
    positions, slots, the SEGMENTS, then chain, each flattened. Never reads tensor values on
    the host (CUDA-graph safe)."""
    n, w = ids.shape
    if out.numel() != n * (3 * w + len(SEGMENTS) + steps) or out.dtype != torch.int64:
        raise ValueError(f"out must hold {n * (3 * w + len(SEGMENTS) + steps)} int64 entries, "
                         f"got {out.numel()} {out.dtype}")
    if not pick_triton(ids, use_triton):
        values = round_inputs(rows, first_pos, lens, roots, ids, req_to_token, steps, sink)
        torch.cat([v.reshape(-1).long() for v in values.values()], out=out)
        return
    triton_module("round_load_triton").load_round_triton(
        rows, first_pos, lens, roots, ids, req_to_token, steps, sink, out)
