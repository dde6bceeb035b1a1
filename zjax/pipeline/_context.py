"""The schedule a model's pipeline uses while it is traced, and whether its parameters are being made."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

from ._config import Pipeline

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("zjax_pipeline", default=None)


@contextlib.contextmanager
def use(pipeline: Pipeline | None) -> Iterator[None]:
    """Make ``pipeline`` the schedule :func:`apply` uses while a model is traced (the train step does this)."""
    token = _CURRENT.set(pipeline)
    try:
        yield
    finally:
        _CURRENT.reset(token)


_INITIALIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("zjax_pipeline_init", default=False)


@contextlib.contextmanager
def initializing() -> Iterator[None]:
    """While a model's parameters are made (``plan.init``): :func:`apply` runs its stages one after the
    other, whatever the mesh (only shapes matter, and the layers may not be sharded yet)."""
    token = _INITIALIZING.set(True)
    try:
        yield
    finally:
        _INITIALIZING.reset(token)


def current() -> Pipeline | None:
    """The schedule set by :func:`use` (the plan's, while its step traces the loss), or ``None``."""
    return _CURRENT.get()


def mesh_sizes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            "zjax.pipeline.apply needs a mesh in context: call it inside plan.train_step's loss, or under "
            "jax.set_mesh(mesh)."
        )
    return dict(mesh.shape)
