"""Few-shot GSM8K: prompts, answer extraction, and an evaluation loop with progress."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "gsm8k"
STOP = ["Question:", "</s>", "<|im_end|>"]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_split(split: str, data_dir: Path = DATA_DIR) -> list:
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.exists():
        raise ValueError(f"GSM8K split {split!r} not found at {path}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def gold_answer(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


def extract_answer(text: str):
    """The last number in the model's answer, commas dropped; None when there is none."""
    text = text.split("Question:")[0]
    nums = _NUMBER.findall(text)
    if not nums:
        return None
    value = nums[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def few_shot_prefix(num_shots: int, train: list) -> str:
    shots = train[:num_shots]
    return "".join(f"Question: {s['question']}\nAnswer: {s['answer'].replace('####', 'The answer is')}\n\n"
                   for s in shots)


def build_prompts(num_questions: int, num_shots: int) -> tuple:
    test = load_split("test")[:num_questions]
    prefix = few_shot_prefix(num_shots, load_split("train")) if num_shots else ""
    prompts = [f"{prefix}Question: {q['question']}\nAnswer:" for q in test]
    return prompts, [gold_answer(q["answer"]) for q in test]


def evaluate(engine, num_questions: int = 8, num_shots: int = 5, max_new_tokens: int = 256,
             batch_size: int = 8, show_progress: bool = True) -> dict:
    from tqdm import tqdm

    prompts, golds = build_prompts(num_questions, num_shots)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "stop": STOP}
    outputs, t0 = [], time.perf_counter()
    bar = tqdm(total=len(prompts), desc="gsm8k", unit="q", disable=not show_progress)
    for i in range(0, len(prompts), batch_size):
        outputs += engine.generate(prompt=prompts[i:i + batch_size], sampling_params=params)
        bar.update(len(prompts[i:i + batch_size]))
    bar.close()
    elapsed = time.perf_counter() - t0
    preds = [extract_answer(o["text"]) for o in outputs]
    num_tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {
        "num_questions": len(prompts), "num_shots": num_shots,
        "accuracy": sum(p == g for p, g in zip(preds, golds)) / max(len(prompts), 1),
        "output_tokens": num_tokens, "elapsed_s": elapsed,
        "output_tokens_per_s": num_tokens / elapsed if elapsed > 0 else 0.0,
        "mean_ttft_s": sum(o["meta_info"]["ttft"] for o in outputs) / max(len(outputs), 1),
        "predictions": preds, "golds": golds, "output_ids": [o["output_ids"] for o in outputs],
        "texts": [o["text"] for o in outputs],
    }
