"""Attention backends and the factory that picks one by name.

The triton and flashinfer backends are imported inside the factory, so `import specpcg` works on
a machine without either package.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from specpcg.attention.base import AttentionBackend

VALID_ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")


def resolve_attention_backend_name(name: str, device) -> str:
    """Maps a requested backend name to the concrete one for `device`; ValueError if impossible.

    auto: triton on CUDA, torch elsewhere. triton off CUDA needs the interpreter
    (TRITON_INTERPRET=1). flashinfer needs the package to be importable.
    """
    device_type = torch.device(device).type
    if name not in VALID_ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not a known backend; "
                         f"valid: {list(VALID_ATTENTION_BACKENDS)}")
    if name == "auto":
        return "triton" if device_type == "cuda" and _importable("triton") else "torch"
    if name == "triton":
        if not _importable("triton"):
            raise ValueError(f"attention_backend={name!r}: triton is not installed; "
                             f"install triton or use attention_backend='torch'")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend={name!r} on device {device_type!r} needs CUDA: "
                             f"Triton kernels run on CPU only under TRITON_INTERPRET=1; "
                             f"use attention_backend='torch' there")
    if name == "flashinfer":
        if not _importable("flashinfer"):
            raise ValueError(f"attention_backend={name!r}: flashinfer is not installed; "
                             f"pip install flashinfer-python or pick another backend")
        if device_type != "cuda":
            raise ValueError(f"attention_backend={name!r} needs a CUDA device, got "
                             f"{device_type!r}; use attention_backend='torch' there")
    return name


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def create_attention_backend(name: str, device, kv_cache, num_heads: int, num_kv_heads: int,
                             head_dim: int, scale: float,
                             verify_kernel: str = "split_k") -> AttentionBackend:
    """verify_kernel: the triton backend's chain-verify kernel (config.TRITON_VERIFY_KERNELS)."""
    resolved = resolve_attention_backend_name(name, device)
    if resolved == "torch":
        from specpcg.attention.torch_backend import TorchAttnBackend as backend_cls
    elif resolved == "triton":
        from specpcg.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(kv_cache, num_heads, num_kv_heads, head_dim, scale,
                                 verify_kernel=verify_kernel)
    else:
        from specpcg.attention.flashinfer_backend import FlashInferAttnBackend as backend_cls
    return backend_cls(kv_cache, num_heads, num_kv_heads, head_dim, scale)


__all__ = ["AttentionBackend", "VALID_ATTENTION_BACKENDS", "create_attention_backend",
           "resolve_attention_backend_name"]
