"""SpecConfig: the speculative settings, auto-resolved as SGLang resolves them, then validated."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NUM_STEPS, DEFAULT_TOPK, DEFAULT_NUM_DRAFT_TOKENS = 3, 1, 4
# A separate draft model proposes one token per step: it has no tree proposer.
CHAIN_ONLY_ALGORITHMS = ("STANDALONE",)


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int  # verify width: the root plus num_draft_tokens - 1 drafts
    draft_model_path: str | None = None
    # BENCHMARK ONLY (not lossless): synthetic acceptance, see accept.simulate_accept.
    simulate_accept_prob: float | None = None
    simulate_seed: int = 0  # the engine's random_seed: seeds the simulated coin flips
    # A running batch of more requests decodes plain (speculative_disable_by_batch_size).
    disable_by_batch_size: int | None = None

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @staticmethod
    def resolve(cfg) -> "SpecConfig":
        """cfg: EngineConfig with speculative_algorithm set."""
        steps = cfg.speculative_num_steps or DEFAULT_NUM_STEPS
        topk = cfg.speculative_eagle_topk or DEFAULT_TOPK
        tokens = cfg.speculative_num_draft_tokens
        if topk == 1:
            # A chain verifies exactly one token per draft step, plus the root.
            if tokens is not None and tokens != steps + 1 and cfg.speculative_num_steps is not None:
                raise ValueError(f"speculative_num_draft_tokens={tokens} does not fit a chain of "
                                 f"speculative_num_steps={steps} (topk 1 needs steps + 1 = {steps + 1})")
            if tokens is not None and cfg.speculative_num_steps is None:
                steps = tokens - 1
            tokens = steps + 1
        elif tokens is None:
            tokens = DEFAULT_NUM_DRAFT_TOKENS
        spec = SpecConfig(cfg.speculative_algorithm, steps, topk, tokens,
                          cfg.speculative_draft_model_path,
                          cfg.speculative_simulate_accept_prob, cfg.random_seed,
                          cfg.speculative_disable_by_batch_size)
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.topk > 1 and self.algorithm in CHAIN_ONLY_ALGORITHMS:
            raise ValueError(f"speculative_eagle_topk={self.topk}: {self.algorithm} drafts chains "
                             f"only (speculative_eagle_topk=1)")
        if self.num_draft_tokens < 2:
            raise ValueError(f"speculative_num_draft_tokens must be >= 2, got {self.num_draft_tokens}")
        most = 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk
        if self.num_draft_tokens > most:
            raise ValueError(f"speculative_num_draft_tokens={self.num_draft_tokens} exceeds the "
                             f"{most} nodes that speculative_num_steps={self.num_steps} and "
                             f"speculative_eagle_topk={self.topk} can draft")
