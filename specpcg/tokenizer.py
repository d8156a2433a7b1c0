"""Tokenizer: a thin wrapper over a Hugging Face tokenizer read from a checkpoint dir or a .gguf."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' info/warning logs (GGUF conversion notes and the like) for a load."""
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


class Tokenizer:
    """Text <-> token ids, plus the chat template, for one model."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase):
        self.hf_tokenizer = hf_tokenizer

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too: every id encode() can return is below this.
        return len(self.hf_tokenizer)

    @property
    def eos_token_ids(self) -> tuple:
        eos = self.hf_tokenizer.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def bos_token_id(self):
        return self.hf_tokenizer.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens only where the tokenizer's own config adds them
        (for example a BOS for Llama 3), never extra ones."""
        return list(self.hf_tokenizer.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered by the chat template, ending with the assistant's
        header so generation continues as the assistant."""
        self._check_chat_template()
        ids = self.hf_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        return [int(i) for i in ids]

    def encode_many(self, texts: list) -> list:
        """`encode` of each text, in one call: the tokenizer encodes a batch on every core."""
        return [list(ids) for ids in self.hf_tokenizer(list(texts))["input_ids"]] if texts else []

    def apply_chat_template_many(self, conversations: list) -> list:
        """`apply_chat_template` of each conversation: rendered one by one (cheap), encoded as
        one batch (the template writes its own special tokens, so none are added)."""
        self._check_chat_template()
        texts = [self.hf_tokenizer.apply_chat_template(m, tokenize=False,
                                                       add_generation_prompt=True)
                 for m in conversations]
        if not texts:
            return []
        return [list(ids) for ids in
                self.hf_tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _check_chat_template(self) -> None:
        if not self.has_chat_template:
            raise ValueError("messages were given but the tokenizer has no chat_template; "
                             "pass a plain prompt instead")


def load_tokenizer(model_path: str) -> Tokenizer:
    """The tokenizer of a Hugging Face directory or of a .gguf file (read from its metadata)."""
    model_path = os.fspath(model_path)
    if not os.path.exists(model_path):
        raise ValueError(f"model_path={model_path!r} does not exist")
    if os.path.isdir(model_path):
        directory, kwargs = model_path, {}
    elif model_path.lower().endswith(".gguf"):
        directory = os.path.dirname(os.path.abspath(model_path))
        kwargs = {"gguf_file": os.path.basename(model_path)}
    else:
        raise ValueError(f"model_path={model_path!r} is neither a Hugging Face checkpoint "
                         "directory nor a .gguf file")
    try:
        with _quiet_transformers():
            hf_tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model_path={model_path!r}: cannot load a tokenizer from it "
                         f"({type(exc).__name__}: {exc})") from exc
    return Tokenizer(hf_tokenizer)
