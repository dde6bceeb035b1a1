"""Packed language-model batches on grain: a row is a function of its global index, a batch of its step.

The corpus is one token stream (documents separated by an end-of-document id). Row ``i`` is the window
``tokens[i*S : i*S + S + 1]`` with ``segment_ids`` (documents numbered from 1 within the row) and
``positions`` (each token's offset in its document), so packed documents neither attend to each other nor
predict across a boundary (:func:`zjax.models.lm_loss`). grain shuffles rows (a new order every epoch)
with random access, so the global batch of step ``s`` is rows ``s*B ... s*B + B - 1`` of that order: the
same whatever the mesh or process count, and a resumed run needs only the step. Each process reads
only the rows its devices hold (:func:`zjax.sharding.process_row_range`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..sharding import process_row_range
from ._sources import read_documents, read_tokens
from ._tokenize import Tokenizer


class PackedRows:
    """Random access to fixed-length rows ``{"tokens", "segment_ids", "positions"}`` of ``S + 1`` entries
    (``{"tokens"}`` alone without an ``eos_id``)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, eos_id: int | None):
        if seq_len < 1:
            raise ValueError(f"zjax.data: seq_len={seq_len} must be >= 1.")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"zjax.data: {len(tokens)} tokens make no row of seq_len + 1 = {seq_len + 1}; use more data or a "
                f"shorter seq_len."
            )
        self.tokens, self.seq_len, self.eos_id = tokens, seq_len, eos_id
        self._ends = np.zeros(0, np.int64) if eos_id is None else np.flatnonzero(np.asarray(tokens) == eos_id)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start = int(i) * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)
        if self.eos_id is None:  # one stream: nothing packed
            return {"tokens": window}
        is_end = window == self.eos_id
        # a token after an end-of-document id starts a new document
        segment = 1 + np.concatenate([[0], np.cumsum(is_end[:-1])]).astype(np.int32)
        before = np.searchsorted(self._ends, start)  # documents ended before the window
        first = 0 if before == 0 else int(self._ends[before - 1]) + 1  # where the window's first document began
        starts = np.concatenate([[first], start + 1 + np.flatnonzero(is_end[:-1])])
        positions = (start + np.arange(len(window)) - starts[segment - 1]).astype(np.int32)
        return {"tokens": window, "segment_ids": segment, "positions": positions}


class LMData:
    """Global batches of packed rows: ``data.batch(step, mesh)`` is this process's rows of step ``step``.

    Args:
      tokens: the token stream (1-D ints; a memory-mapped ``.npy`` works).
      seq_len: tokens per row (each row holds ``seq_len + 1``: inputs and shifted targets).
      batch_size: rows per global batch.
      eos_id: the end-of-document id that separates packed documents (``None``: one stream, no segments).
      seed: the shuffle seed; ``shuffle=False`` keeps corpus order (evaluation).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        *,
        eos_id: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ):
        import grain

        self.rows = PackedRows(tokens, seq_len, eos_id)
        self.batch_size = batch_size
        ds = grain.MapDataset.source(self.rows)
        self._order = (ds.shuffle(seed=seed) if shuffle else ds).repeat(None)  # a new order every epoch

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def batch(self, step: int, mesh: Any = None) -> dict[str, np.ndarray]:
        """The rows of global batch ``step`` this process feeds to ``plan.shard_batch`` (all of them
        without ``mesh``), reading only those: ``tokens``, and ``segment_ids`` and ``positions`` when documents
        are packed (an ``eos_id``)."""
        lo, hi = (0, self.batch_size) if mesh is None else process_row_range(self.batch_size, mesh)
        base = step * self.batch_size
        rows = [self._order[base + r] for r in range(lo, hi)]
        return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

    def epoch_batches(self, mesh: Any = None) -> Iterator[dict[str, np.ndarray]]:
        """Every whole batch of one pass in order (evaluation): ``num_rows // batch_size`` batches."""
        for step in range(self.num_rows // self.batch_size):
            yield self.batch(step, mesh)


def tokenize(path: str | os.PathLike, tokenizer: Tokenizer, text_key: str = "text") -> np.ndarray:
    """The token stream of every document under ``path`` (each followed by the tokenizer's end-of-document
    id), or a pre-tokenized ``.npy`` file as it is."""
    if os.fspath(path).endswith(".npy"):
        return read_tokens(path)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    parts = [
        np.concatenate([tokenizer.encode(doc), np.asarray(eos, np.int32)]) for doc in read_documents(path, text_key)
    ]
    if not parts:
        raise ValueError(f"zjax.data: no documents under {os.fspath(path)!r}.")
    return np.concatenate(parts).astype(np.int32)


def train_eval_split(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The stream's first ``1 - eval_fraction`` for training, the rest held out (contiguous, no overlap)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"zjax.data: eval_fraction={eval_fraction} must be in [0, 1).")
    cut = int(len(tokens) * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]
