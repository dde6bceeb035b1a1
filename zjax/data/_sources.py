"""Documents from local files: plain text, JSON lines, Parquet (with pyarrow), or pre-tokenized arrays."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        out = []
        for root, _, names in sorted(os.walk(path)):
            out += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        return out
    if not os.path.exists(path):
        raise FileNotFoundError(f"zjax.data: {path!r} does not exist.")
    return [path]


def read_documents(path: str | os.PathLike, text_key: str = "text") -> Iterator[str]:
    """Each document under ``path`` (a file or a directory, read in sorted order): a text file is one
    document; a ``.jsonl`` file one per line (its ``text_key`` field); a ``.parquet`` file one per row."""
    for file in _files(os.fspath(path)):
        if file.endswith(".jsonl"):
            with open(file) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if not isinstance(record, dict) or text_key not in record:
                        raise ValueError(f"zjax.data: {file}:{n} has no {text_key!r} field (pass text_key=...).")
                    yield str(record[text_key])
        elif file.endswith(".parquet"):
            yield from _parquet_documents(file, text_key)
        elif file.endswith((".npy", ".bin")):
            continue  # token arrays are read by read_tokens
        else:
            with open(file, encoding="utf-8", errors="replace") as f:
                yield f.read()


def _parquet_documents(file: str, text_key: str) -> Iterator[str]:
    """One document per row of ``file``'s ``text_key`` column, read a record batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f'zjax.data: reading {file!r} needs pyarrow: pip install "zjax[parquet]".') from e
    parquet = pq.ParquetFile(file)
    if text_key not in parquet.schema_arrow.names:
        raise ValueError(
            f"zjax.data: {file} has no {text_key!r} column (columns: {parquet.schema_arrow.names}); pass text_key=..."
        )
    for batch in parquet.iter_batches(columns=[text_key], batch_size=1024):
        yield from (str(t) for t in batch.column(0).to_pylist())


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """A pre-tokenized corpus: a 1-D ``.npy`` array of token ids (memory-mapped), documents separated by the
    tokenizer's end-of-document id."""
    path = os.fspath(path)
    array = np.load(path, mmap_mode="r")
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"zjax.data: {path!r} holds {array.dtype} {array.shape}; expected a 1-D integer token array.")
    return array
