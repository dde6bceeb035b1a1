"""Tokenizers: Hugging Face ``tokenizers`` from a ``tokenizer.json`` (or a checkpoint directory), or bytes."""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np

from .._extras import require


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255 and an end-of-document id 256: no files needed."""

    vocab_size = 257
    eos_id: int | None = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (``tokenizer.json``); ``eos_id`` from its special tokens."""

    _EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>", "<eos>")

    def __init__(self, path: str | os.PathLike):
        require("tokenizers", "a tokenizer.json (zjax.data.HFTokenizer)")
        from tokenizers import Tokenizer as _Tokenizer

        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"zjax.data: no tokenizer at {file!r} (a tokenizer.json or a directory holding one)."
            )
        self._tok = _Tokenizer.from_file(file)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = next((i for t in self._EOS if (i := self._tok.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer at ``path`` (``tokenizer.json`` or a directory), or :class:`ByteTokenizer` for ``None``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
