"""Read the logical axis names that flax attaches to parameters.

Two kinds of annotation are understood:

* flax linen ``nn.with_logical_partitioning`` / ``nn.Partitioned`` boxes (``.names``), which are stripped,
  since linen's ``apply`` takes plain arrays;
* flax nnx variables with ``out_sharding`` metadata (``nnx.with_partitioning``), which are kept, since
  nnx users ``nnx.merge`` the state back into their module.

Everything else is an unannotated leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from flax.core import meta


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array leaf of a parameter tree, in flatten order."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    names: tuple[str | None, ...] | None  # logical axis names, or None if unannotated


def _is_box(x: Any) -> bool:
    return isinstance(x, (meta.Partitioned, nnx.Variable))


def path_str(path: tuple[Any, ...]) -> str:
    """A '/'-joined path (``params/layers/mlp/kernel``), used in rules and error messages."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name != "value":  # nnx.Variable's child
                parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _names_of(box: Any) -> tuple[str | None, ...] | None:
    if isinstance(box, meta.Partitioned):
        return tuple(box.names)
    sharding = box.get_metadata().get("out_sharding")
    if not sharding:
        return None
    return tuple(sharding)


def unbox(tree: Any) -> Any:
    """Strip linen ``Partitioned`` boxes; keep nnx variables (they are pytree nodes over their value)."""
    return jax.tree.map(
        lambda x: x.unbox() if isinstance(x, meta.Partitioned) else x,
        tree,
        is_leaf=lambda x: isinstance(x, meta.Partitioned),
    )


def read_leaves(tree: Any) -> list[Leaf]:
    """The array leaves of ``tree`` (concrete or abstract) with their logical names, in flatten order.

    The order equals ``jax.tree.leaves(unbox(tree))``.
    """
    leaves = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]:
        names = None
        value = node
        if _is_box(node):
            names = _names_of(node)
            value = node.unbox() if isinstance(node, meta.Partitioned) else node.get_value()
            inner = jax.tree.leaves(value)
            if len(inner) != 1:
                raise TypeError(
                    f"Parameter {path_str(path)!r}: an annotated variable must hold one array, got {len(inner)} leaves."
                )
            value = inner[0]
        shape = tuple(getattr(value, "shape", ()))
        dtype = getattr(value, "dtype", None)
        if names is not None and len(names) != len(shape):
            raise ValueError(
                f"Parameter {path_str(path)!r} with shape {shape} has {len(names)} logical axis names "
                f"{names}; give exactly one name (or None) per dimension."
            )
        leaves.append(Leaf(path_str(path), shape, dtype, names))
    return leaves
