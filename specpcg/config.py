"""EngineConfig: every engine argument (SGLang's names), validated once, frozen after."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# How the triton backend attends in a chain's TARGET_VERIFY. "extend": the prefill kernel (one
# program per request, head and query block walks the whole prefix); "split_k": node j of a
# request is a decode query over its first seq_len - N + 1 + j positions, so the split-K decode
# kernel spreads the prefix over many programs (a batch-1 verify otherwise keeps few SMs busy).
TRITON_VERIFY_KERNELS = ("auto", "extend", "split_k")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model_path: Optional[str] = None  # HF dir, .gguf file, "shape:<preset>", None = default
    tokenizer_path: Optional[str] = None
    skip_tokenizer_init: bool = False  # no tokenizer: input_ids in, output_ids out
    load_format: str = "auto"  # "dummy": the checkpoint's shape with random weights
    device: str = "auto"
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    attention_backend: str = "auto"
    # One of TRITON_VERIFY_KERNELS. split_k: a batch-1 verify of 8 nodes took 1.17 ms of GPU
    # time against 1.56 ms with the prefill kernel (H100, benchmarks/results/step.jsonl); at
    # batch 16 and 64 the prefill kernel, which reads each request's keys once for all its
    # nodes, took 4-14% less kernel time a step (step_probe.jsonl). auto: split-K while the
    # prefill kernel's programs (requests x heads) would not fill the GPU, else extend. NOTE:
    # split_k stays the default: only there is a verify node's attention bitwise the decode
    # query at its position (README, "Lossless in bf16"), which auto gives up at large batches.
    triton_verify_kernel: str = "split_k"
    context_length: Optional[int] = None
    mem_fraction_static: float = 0.8  # GPU: share of free memory for weights + KV
    max_total_tokens: Optional[int] = None  # KV slots; CPU default 32768
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # token budget of one prefill forward
    # While a batch decodes, a prefill admits new requests only once it can admit this many
    # (or all that wait). Each prefill step stalls every running request for one forward, so
    # admitting requests one by one as slots free up costs offline generation about half its
    # throughput; 1 (admit at once) keeps time to first token lowest when serving.
    min_prefill_requests: int = 1
    random_seed: int = 0
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    # BENCHMARK ONLY, not lossless: greedy requests accept each draft along the first-child
    # chain with this probability (seeded by random_seed), ignoring the target's verdict; the
    # bonus token is still the target's argmax. Like SGLang's SGLANG_SIMULATE_ACC_LEN.
    speculative_simulate_accept_prob: Optional[float] = None
    disable_cuda_graph: bool = False
    disable_piecewise_cuda_graph: bool = False
    # Batch-invariant kernels on CUDA (SGLang's name): every linear layer and the LM head run
    # one fixed-tiling Triton matmul, so a request's tokens do not depend on its batch.
    enable_deterministic_inference: bool = False
    enforce_piecewise_cuda_graph: bool = False
    # Plain decode steps run one ahead of their results (SGLang's name for the switch).
    disable_overlap_schedule: bool = False
    # Speculate at every batch size. By default the engine measures, per running-batch size,
    # speculative against plain decode steps and runs the faster (specpcg/speculative/adaptive.py).
    disable_adaptive_speculation: bool = False
    # A running batch of more requests than this decodes without speculation, adaptive or not,
    # and adaptive speculation spends no look above it (vLLM's name; None: no cap). For drafts
    # known not to pay at large batches: there it runs as fast as plain decoding.
    speculative_disable_by_batch_size: Optional[int] = None
    cuda_graph_max_bs: int = 64
    pp_size: int = 1  # pipeline parallel stages: one process each (specpcg/distributed)
    tp_size: int = 1  # tensor parallel ranks: one process each (specpcg/distributed)
    dist_init_addr: Optional[str] = None  # host:port of rank 0 (default: a free local port)
    nnodes: int = 1
    node_rank: int = 0
    dist_timeout_s: float = 60.0  # a collective waiting longer means a rank is gone
    piecewise_cuda_graph_max_tokens: int = 4096
    show_progress: bool = True
    log_level: str = "warning"

    def __post_init__(self):
        self._validate()

    @property
    def speculation_pauses(self) -> bool:
        """Whether a draft sees plain decode steps between speculative ones (adaptive
        speculation, or a batch above speculative_disable_by_batch_size): then it catches up."""
        return (not self.disable_adaptive_speculation
                or self.speculative_disable_by_batch_size is not None)

    def _validate_nodes(self) -> None:
        """Several machines: each runs tp_size * pp_size / nnodes ranks; node 0 runs rank 0."""
        n, k = self.nnodes, self.node_rank
        _check_positive_int("nnodes", n)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise ValueError(f"node_rank must be in [0, nnodes={n}), got {k!r}")
        if n > 1 and (self.tp_size * self.pp_size) % n:
            raise ValueError(f"nnodes={n} must divide tp_size * pp_size = "
                             f"{self.tp_size * self.pp_size}: every node runs as many ranks")
        if n > 1 and not self.dist_init_addr:
            raise ValueError(f"dist_init_addr (host:port of node 0) is required with nnodes={n}")

    @staticmethod
    def from_kwargs(kwargs: dict) -> "EngineConfig":
        reject_unknown(kwargs, EngineConfig, "Engine argument")
        return EngineConfig(**kwargs)

    def _validate(self) -> None:
        algo = self.speculative_algorithm
        if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm {algo!r} is unknown; choose one of "
                             f"{list(SPECULATIVE_ALGORITHMS)} or None")
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("triton_verify_kernel", self.triton_verify_kernel, TRITON_VERIFY_KERNELS)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("dtype", self.dtype, tuple(DTYPES))
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        if isinstance(self.pp_size, bool) or not isinstance(self.pp_size, int) or \
                self.pp_size < 1:
            raise ValueError(f"pp_size must be a positive integer, got {self.pp_size!r}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or \
                self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        self._validate_nodes()
        p = self.speculative_simulate_accept_prob
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0 < p <= 1):
            raise ValueError(f"speculative_simulate_accept_prob must be in (0, 1], got {p!r}")
        if p is not None and algo is None:
            raise ValueError(f"speculative_simulate_accept_prob={p!r} needs a "
                             f"speculative_algorithm")
        for name in ("max_running_requests", "chunked_prefill_size", "min_prefill_requests",
                     "cuda_graph_max_bs",
                     "piecewise_cuda_graph_max_tokens"):
            _check_positive_int(name, getattr(self, name))
        for name in ("max_total_tokens", "context_length", "speculative_num_steps",
                     "speculative_eagle_topk", "speculative_num_draft_tokens",
                     "speculative_disable_by_batch_size"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {self.device!r} is not a device torch knows (use 'auto', "
                             f"'cpu', 'cuda' or 'cuda:N')") from exc
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: only 'cpu' and 'cuda' are supported")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but CUDA is not available")
        return dev

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        dtype = DTYPES[self.dtype]
        if dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return dtype

    def resolve_verify_kernel(self) -> str:
        """The triton backend's chain-verify kernel on every rank. The deterministic mode keeps
        a verify's nodes on the decode kernel (split_k), the kernel a plain decode step runs,
        so that a verified token is computed as decoding computes it: auto would move large
        batches to the extend kernel."""
        if self.triton_verify_kernel == "auto" and self.enable_deterministic_inference:
            return "split_k"
        return self.triton_verify_kernel


def reject_unknown(kwargs: dict, cls, what: str) -> None:
    """ValueError naming every key of `kwargs` that is not a field of the dataclass `cls`."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; known: {sorted(known)}")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not one of {list(choices)}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
