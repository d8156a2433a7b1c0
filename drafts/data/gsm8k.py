"""GSM8K questions (MIT; benchmarks/data/gsm8k): train split to train on, test split held out.

Two formats, both as users send them:
- `gsm8k`: zero-shot through the chat template, asking for steps ("Let's think step by step.");
- `gsm8k-fewshot`: the benchmark's plain-text few-shot prompt (`specpcg.gsm8k.build_prompts`).
"""

from __future__ import annotations

from drafts.data.base import Sample, Source
from specpcg.gsm8k import few_shot_prefix, load_split

ZERO_SHOT_SUFFIX = "\nLet's think step by step."
NUM_SHOTS = 5  # the benchmark's few-shot count


def zero_shot_message(question: str) -> str:
    return question + ZERO_SHOT_SUFFIX


class Gsm8kChat(Source):
    name = "gsm8k"

    def train(self) -> list:
        return [Sample(user_turns=(zero_shot_message(q["question"]),), source=self.name)
                for q in load_split("train")]

    def heldout(self) -> list:
        return [Sample(user_turns=(zero_shot_message(q["question"]),), source=self.name)
                for q in load_split("test")]


class Gsm8kFewShot(Source):
    """The exemplars are the train split's first NUM_SHOTS rows and are never questions."""

    name = "gsm8k-fewshot"

    def _samples(self, rows: list) -> list:
        prefix = few_shot_prefix(NUM_SHOTS, load_split("train"))
        return [Sample(text=f"{prefix}Question: {q['question']}\nAnswer:", source=self.name)
                for q in rows]

    def train(self) -> list:
        return self._samples(load_split("train")[NUM_SHOTS:])

    def heldout(self) -> list:
        return self._samples(load_split("test"))
