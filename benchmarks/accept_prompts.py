"""Prompt sets of bench_accept.py: a chat-style set (written for this benchmark) and random
token-id prompts made of a repeated segment (the n-gram index then always finds a match)."""

from __future__ import annotations

import torch

CHAT_PROMPTS = [
    "What are three tips for staying focused while working from home?",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "How do I make a simple tomato pasta sauce?",
    "What is the difference between weather and climate?",
    "Give me a packing list for a weekend camping trip.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "Write a polite email asking my manager for a day off next Friday.",
    "What are the health benefits of regular walking?",
    "Explain recursion in programming with a simple example.",
    "Suggest five names for a small coffee shop.",
    "How does a refrigerator keep food cold?",
    "What should I consider when adopting a dog?",
    "Write a haiku about the ocean.",
    "Explain the rules of chess briefly.",
    "What is photosynthesis?",
    "Give me a simple weekly workout plan for a beginner.",
    "How can I improve my public speaking skills?",
    "Describe the water cycle step by step.",
    "Write a Python function that checks whether a number is prime.",
    "What are some good habits for better sleep?",
    "Tell me a short story about a robot who learns to paint.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain the difference between a virus and a bacterium.",
    "How do I change a flat tire on a car?",
    "List the planets of the solar system in order from the sun.",
    "What is inflation and why does it happen?",
    "Give me three ideas for a rainy-day activity with kids.",
    "How do vaccines train the immune system?",
    "Write a thank-you note to a friend who helped me move.",
    "What is the Pythagorean theorem? Give an example.",
    "Explain how a bill becomes a law in simple terms.",
    "What are the pros and cons of electric cars?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "How do I start learning to play the guitar?",
    "Why do leaves change color in the fall?",
    "Explain what machine learning is in two paragraphs.",
    "What are some tips for saving money on groceries?",
    "Describe a perfect day in a city you love.",
]


def chat_messages(num: int) -> list:
    """`num` single-turn conversations (the list repeats past its 40 prompts)."""
    return [[{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]
            for i in range(num)]


def repeated_id_prompts(num: int, length: int, segment: int, vocab_size: int,
                        seed: int = 0) -> list:
    """`num` prompts of `length` ids: a random `segment`-id run repeated (ids 100 .. 32000, below
    the vocabulary), so every suffix of the prompt recurs and NGRAM proposes full chains."""
    gen = torch.Generator().manual_seed(seed)
    high = min(vocab_size, 32000)
    prompts = []
    for _ in range(num):
        seg = torch.randint(100, high, (segment,), generator=gen).tolist()
        prompts.append((seg * (length // segment + 1))[:length])
    return prompts
