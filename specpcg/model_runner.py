"""ModelRunner: ForwardBatch -> model body -> LM head -> logits (+ hidden states)."""

from __future__ import annotations

import torch

from specpcg.core import CaptureHiddenMode, ForwardBatch, ModelOutput
from specpcg.forward_context import ForwardContext, forward_context


class ModelRunner:
    def __init__(self, model, kv_cache, attn_backend, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.device = device

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        hidden, aux = self.forward_body(batch)
        return self.postprocess(hidden, aux, batch)

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

    def postprocess(self, hidden: torch.Tensor, aux: list, batch: ForwardBatch) -> ModelOutput:
        """Runs eagerly after the body: LM head on the rows asked for, hidden-state selection."""
        num_tokens = batch.num_tokens
        hidden, aux = hidden[:num_tokens], [a[:num_tokens] for a in aux]
        last_rows = torch.cumsum(batch.extend_seq_lens, 0) - 1  # [bs]
        all_logits = None
        if batch.return_all_logits:
            all_logits = self.model.compute_logits(hidden)
            logits = all_logits[last_rows]
        else:
            logits = self.model.compute_logits(hidden[last_rows])
        mode = batch.capture_hidden_mode
        rows = None if mode == CaptureHiddenMode.FULL else last_rows
        hidden_out = aux_out = None
        if mode != CaptureHiddenMode.NULL:
            hidden_out = hidden if rows is None else hidden[rows]
            aux_out = [a if rows is None else a[rows] for a in aux]
        return ModelOutput(logits=logits, all_logits=all_logits, hidden_states=hidden_out,
                           aux_hidden_states=aux_out)
