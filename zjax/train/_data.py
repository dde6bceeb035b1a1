"""Where the loop's batches come from: random access by step (``zjax.data.LMData``) or any iterable."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any


class Batches:
    """The training batches of steps ``start, start + 1, ...``, on this process, as numpy trees.

    ``data`` is one of: an object with ``batch(step, mesh)`` (e.g. :class:`zjax.data.LMData`: the batch is a
    function of the step, so a resumed run needs only its position); a function ``step -> batch``; or any
    iterable of batches (a generator, a list), from which a resumed run skips the ``start`` batches it saw.

    Raises:
      TypeError: ``data`` is none of these.
    """

    def __init__(self, data: Any, mesh: Any, start: int):
        self._fetch: Callable[[int], Any]
        if hasattr(data, "batch") and callable(data.batch):
            self._fetch = lambda i: data.batch(i, mesh)
        elif callable(data):
            self._fetch = data
        elif isinstance(data, Iterable):
            it = itertools.islice(iter(data), start, None)  # the batches a resumed run already trained on
            self._fetch = lambda i: _next(it, i)
        else:
            raise TypeError(
                f"zjax.train.fit: data of type {type(data).__name__} gives no batches; pass zjax.data.LMData, a "
                "function step -> batch, or an iterable of batches."
            )

    def __call__(self, step: int) -> Any:
        return self._fetch(step)


def _next(it: Iterator[Any], step: int) -> Any:
    try:
        return next(it)
    except StopIteration:
        raise ValueError(
            f"zjax.train.fit: data ran out at step {step}; give at least LoopConfig.steps batches (or fewer steps)."
        ) from None


def eval_batches(eval_data: Any, mesh: Any, count: int) -> list[Any]:
    """Up to ``count`` held-out batches, the same ones at every evaluation.

    ``eval_data``: an object with ``epoch_batches(mesh)`` (:class:`zjax.data.LMData`), a function returning an
    iterable, or a re-iterable collection (a list; an iterator would be used up by the first evaluation).

    Raises:
      TypeError: ``eval_data`` is a one-shot iterator or gives no batches.
      ValueError: it holds no batch.
    """
    if hasattr(eval_data, "epoch_batches"):
        source = eval_data.epoch_batches(mesh)
    elif callable(eval_data):
        source = eval_data()
    elif isinstance(eval_data, Iterator):
        raise TypeError(
            "zjax.train.fit: eval_data is an iterator, which the first evaluation would use up; pass a list or a "
            "function returning a fresh iterable."
        )
    elif isinstance(eval_data, Iterable):
        source = eval_data
    else:
        raise TypeError(f"zjax.train.fit: eval_data of type {type(eval_data).__name__} gives no batches.")
    batches = list(itertools.islice(source, count))
    if not batches:
        raise ValueError("zjax.train.fit: eval_data holds no whole batch; give more held-out data or smaller batches.")
    return batches
