"""ModelRunner: ForwardBatch -> model body -> LM head -> logits (+ hidden states)."""

from __future__ import annotations

import torch

from specpcg.core import CaptureHiddenMode, ForwardBatch, ForwardMode, ModelOutput
from specpcg.forward_context import ForwardContext, forward_context


class ModelRunner:
    def __init__(self, model, kv_cache, attn_backend, device: torch.device,
                 before_forward=None):
        """before_forward(batch, route="eager"): called before every forward, with the graph
        runner's name when the router replays one (parallel ranks mirror it there)."""
        self.model = model
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.device = device
        self.before_forward = before_forward
        # A draft head's ring its DECODE steps write their hidden rows to (specpcg/hidden_ring.py)
        self.hidden_ring = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        if batch.rows_pending:  # before other ranks copy the batch's req_to_token rows
            self.kv_cache.write_rows(batch)
        if self.before_forward is not None:
            self.before_forward(batch)
        hidden, aux = self.forward_body(batch)
        if not self.writes_ring(batch):
            return self.postprocess(hidden, aux, batch)
        self.write_ring(batch, hidden, aux)
        return self.postprocess(hidden, [], batch, in_ring=True)

    def forward_body(self, batch: ForwardBatch):
        """The part a graph may replay: embeddings, decoder layers, final norm."""
        self.attn_backend.init_forward_metadata(batch)
        ctx = ForwardContext(batch=batch, attn_backend=self.attn_backend, num_tokens=batch.num_tokens)
        with forward_context(ctx):
            return self.call_model(batch)

    def call_model(self, batch: ForwardBatch):
        """The model's body on the batch's inputs (a draft head also takes hidden states)."""
        if batch.input_hidden is None:
            return self.model(batch.input_ids, batch.positions, batch.aux_hidden_layers)
        return self.model(batch.input_ids, batch.positions, batch.aux_hidden_layers,
                          input_hidden=batch.input_hidden)

    def writes_ring(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a DECODE step that writes its hidden rows to the draft's ring."""
        return (self.hidden_ring is not None and batch.forward_mode == ForwardMode.DECODE
                and batch.capture_hidden_mode != CaptureHiddenMode.NULL)

    def write_ring(self, batch: ForwardBatch, hidden: torch.Tensor, aux: list,
                   logits: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's rows to the ring: the aux layers' side by side, else the last layer's.
        With `logits` ([n, V], a row each), each row's greedy pick in the same launch: the
        picks ([n] int64), else None."""
        sources = list(aux) if batch.aux_hidden_layers else [hidden]
        return self.hidden_ring.write(sources, batch.positions, batch.req_pool_indices, logits)

    def postprocess(self, hidden: torch.Tensor, aux: list, batch: ForwardBatch,
                    logits: torch.Tensor | None = None,
                    greedy_ids: torch.Tensor | None = None, in_ring: bool = False) -> ModelOutput:
        """Runs eagerly after the body: LM head on the rows asked for, hidden-state selection.
        logits: every row's logits when the body computed them already (a decode graph);
        greedy_ids: each row's argmax when it did that too (a DECODE graph: one row a request);
        in_ring: the step wrote its hidden rows to the draft's ring (aux then left out)."""
        num_tokens = batch.num_tokens
        if hidden.shape[0] != num_tokens:  # a graph's padded rows (slicing costs the host)
            hidden, aux = hidden[:num_tokens], [a[:num_tokens] for a in aux]
            logits = None if logits is None else logits[:num_tokens]
            greedy_ids = None if greedy_ids is None else greedy_ids[:num_tokens]
        last = last_rows(batch)
        if logits is not None:
            all_logits = logits
            last_logits = last(all_logits)
        elif batch.return_all_logits:
            all_logits = self.model.compute_logits(hidden)
            last_logits = last(all_logits)
        else:
            all_logits, last_logits = None, self.model.compute_logits(last(hidden))
        mode = batch.capture_hidden_mode
        hidden_out = aux_out = None
        if mode == CaptureHiddenMode.FULL:
            hidden_out, aux_out = hidden, aux
        elif mode != CaptureHiddenMode.NULL:
            hidden_out, aux_out = last(hidden), [last(a) for a in aux]
        return ModelOutput(logits=last_logits,
                           all_logits=all_logits if batch.return_all_logits else None,
                           hidden_states=hidden_out, aux_hidden_states=aux_out,
                           greedy_ids=greedy_ids, hidden_in_ring=in_ring)


def last_rows(batch: ForwardBatch):
    """A function picking each request's last row of a [num_tokens, ...] tensor. When every
    request has the same number of rows it is a view (no index built on the device)."""
    lens = batch.extend_seq_lens_cpu
    width = lens[0] if lens and all(n == lens[0] for n in lens) else None
    if width == 1:
        return lambda x: x
    if width:
        return lambda x: x.view(len(lens), width, *x.shape[1:])[:, -1]
    rows = torch.cumsum(batch.extend_seq_lens, 0) - 1  # [bs]
    return lambda x: x[rows]
