"""A gpt-fast-style peer: one decode step over a static KV cache, written plainly in torch so
torch.compile(mode="reduce-overhead") can fuse it and replay it as one CUDA graph.

It borrows the weights of one of our models (LlamaForCausalLM: fused q/k/v and gate/up, the
rotary table), so both sides run the same shapes and numbers. The cache is [layers, batch,
kv heads, max_len, head_dim]; every step attends over all max_len positions under a mask, as
gpt-fast does, so shapes never change between steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, cos, sin):
    """Neox layout: the first and second halves of the head dim rotate together."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class StaticCacheDecoder(torch.nn.Module):
    def __init__(self, model, batch_size: int, max_len: int):
        super().__init__()
        self.m, self.cfg = model, model.config
        c = self.cfg
        p = next(model.parameters())
        shape = (c.num_layers, batch_size, c.num_kv_heads, max_len, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.max_len = max_len

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B] the tokens at positions pos [B] (int64); returns logits [B, vocab]."""
        c, m = self.cfg, self.m.model
        bs = ids.shape[0]
        cos, sin = self.m.model.rotary.cos_sin[pos].to(self.k_cache.dtype).chunk(2, -1)
        cos, sin = cos[:, None, None], sin[:, None, None]  # [B, 1, 1, D / 2]
        visible = torch.arange(self.max_len, device=ids.device)[None, :] <= pos[:, None]
        mask = visible[:, None, None, :]  # [B, 1, 1, max_len]
        x = m.embed_tokens(ids)  # [B, H]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        rows = torch.arange(bs, device=ids.device)
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q, k, v = F.linear(h, a.qkv_proj.weight, a.qkv_proj.bias).split(
                [q_size, kv_size, kv_size], -1)
            q = _rope(q.view(bs, c.num_heads, 1, c.head_dim), cos, sin)
            k = _rope(k.view(bs, c.num_kv_heads, 1, c.head_dim), cos, sin)
            self.k_cache[i, rows, :, pos] = k[:, :, 0]
            self.v_cache[i, rows, :, pos] = v.view(bs, c.num_kv_heads, c.head_dim)
            o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i],
                                               attn_mask=mask, enable_gqa=True)
            x = x + F.linear(o.reshape(bs, q_size), a.o_proj.weight)
            h = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            gate, up = F.linear(h, layer.mlp.gate_up_proj.weight).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
        x = _rms(x, m.norm.weight, c.rms_norm_eps)
        return F.linear(x, self.m.head_weight).float()

    def prefill(self, prompts: list) -> torch.Tensor:
        """Feeds equal-length prompts one position at a time (the benchmark times decode
        only); returns the last logits [B, vocab]."""
        ids = torch.tensor(prompts, device=self.k_cache.device)  # [B, P]
        for p in range(ids.shape[1]):
            logits = self(ids[:, p], torch.full((ids.shape[0],), p, device=ids.device))
        return logits
