"""``zjax.hf.save``: a sharded state as a Hugging Face checkpoint, one tensor at a time, atomically.

Each Hugging Face tensor (one layer of one stacked leaf; one expert of one layer of a mixture of experts)
is assembled on process 0's host from the device shards that hold it: copies of the shards' pieces when
they are all addressable, otherwise one cross-process gather of that tensor alone. Neither a device nor a
host ever holds the whole model: the host holds at most one output file (``max_shard_size``) plus one
tensor. Files are written into a temporary directory beside ``out_dir`` and renamed into place only when
complete.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import uuid
from typing import Any

import jax
import numpy as np

from .._extras import require
from ..core import TrainState
from ..models import Decoder, config_to_hf
from ..planner._gpu import parse_size
from ._files import INDEX, SINGLE
from ._names import Tensor, tensors

_DTYPES = ("float32", "bfloat16", "float16")


@functools.partial(jax.jit, static_argnums=2)
def _take(arr: jax.Array, at: jax.Array, lead: int) -> jax.Array:
    """``arr[at]`` over the ``lead`` leading axes, the index traced: one compilation per leaf, not per tensor."""
    start: list[Any] = [at[k] for k in range(lead)] + [0] * (arr.ndim - lead)
    return jax.lax.dynamic_slice(arr, start, (1,) * lead + arr.shape[lead:]).reshape(arr.shape[lead:])


def _host_tensor(arr: jax.Array, at: tuple[int, ...]) -> np.ndarray:
    """``arr[at]`` on this host, in ``arr``'s dtype: ``at`` indexes the leading layers and experts axes (``()``:
    the whole leaf)."""
    lead = len(at)
    if not arr.is_fully_addressable:
        from jax.experimental import multihost_utils

        piece = _take(arr, np.asarray(at, np.int32), lead) if lead else arr
        return np.asarray(multihost_utils.process_allgather(piece, tiled=True))
    out = np.empty(arr.shape[lead:], arr.dtype)
    for shard in arr.addressable_shards:
        if shard.replica_id:
            continue
        index = shard.index
        starts = [index[k].indices(arr.shape[k])[:2] for k in range(lead)]
        if all(start <= a < stop for a, (start, stop) in zip(at, starts, strict=True)):
            rel = tuple(a - start for a, (start, _) in zip(at, starts, strict=True))
            out[index[lead:]] = np.asarray(shard.data[rel] if lead else shard.data)
    return out


def _to_hf(t: Tensor, x: np.ndarray, dtype: Any) -> np.ndarray:
    order = [d for group in t.hf_dims for d in group]
    return np.ascontiguousarray(x.transpose(order).reshape(t.hf_shape).astype(dtype))


def _file_plan(entries: list[tuple[Tensor, str, tuple[int, ...]]], itemsize: int, limit: float) -> list[list[int]]:
    """Entries grouped into files of at most ``limit`` bytes (a larger tensor gets a file of its own)."""
    files: list[list[int]] = [[]]
    size = 0
    for i, (t, _, _) in enumerate(entries):
        nbytes = int(np.prod(t.hf_shape)) * itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    return files


def save(
    out_dir: str | os.PathLike,
    model: Decoder,
    state: TrainState,
    *,
    dtype: str = "bfloat16",
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> str:
    """Write ``state``'s weights as a Hugging Face checkpoint: ``config.json`` and safetensors files
    (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``).

    Args:
      out_dir: the checkpoint directory to create (an existing empty directory is filled).
      model: the :class:`~zjax.models.Decoder` the state trains.
      state: a sharded state (any plan); its fp32 master weights are written when it has them.
      dtype: ``"bfloat16"`` (Hugging Face's usual), ``"float16"`` or ``"float32"`` (lossless).
      max_shard_size: the largest file, e.g. ``"5GB"`` or bytes; a tensor larger than that gets its own.
      overwrite: replace an existing non-empty ``out_dir`` (only after the new checkpoint is complete).

    Every process calls it (multi-process jobs gather one tensor at a time); process 0 writes. A save
    that fails or is killed leaves ``out_dir`` as it was.

    Returns:
      The checkpoint directory.
    """
    require("safetensors", "zjax.hf.save")
    import ml_dtypes
    from safetensors.numpy import save_file

    if not isinstance(model, Decoder):
        raise TypeError(f"zjax.hf.save: model must be a zjax.models.Decoder, got {type(model).__name__}.")
    if dtype not in _DTYPES:
        raise ValueError(f"zjax.hf.save: dtype={dtype!r}; choose one of {list(_DTYPES)}.")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else float(max_shard_size)
    if limit <= 0:
        raise ValueError(f"zjax.hf.save: max_shard_size={max_shard_size!r} must be positive.")
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"zjax.hf.save: {out!r} is a file, not a directory; pick a directory.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(
            f"zjax.hf.save: {out!r} exists and is not empty; pass overwrite=True to replace it, or pick a new "
            "or empty directory."
        )
    cfg = model.cfg
    values = state.params if state.opt_state.master is None else state.opt_state.master
    leaves = {  # the parameters', and the model state's under its collection's name (the routers' biases)
        tuple(str(getattr(k, "key", k)) for k in p): x
        for tree in (values, state.model_state or {})
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    entries: list[tuple[Tensor, str, tuple[int, ...]]] = []
    for t in tensors(cfg):
        if t.path not in leaves:
            raise ValueError(f"zjax.hf.save: the state has no parameter {'/'.join(t.path)}; is it this model's state?")
        expect = t.leading + t.shape
        if tuple(leaves[t.path].shape) != expect:
            raise ValueError(
                f"zjax.hf.save: parameter {'/'.join(t.path)} has shape {tuple(leaves[t.path].shape)}; the model "
                f"makes it {expect}. Pass the model this state trains."
            )
        entries += [(t, t.name_at(at), at) for at in t.indices()]
    groups = _file_plan(entries, np_dtype.itemsize, limit)
    names = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    )
    writer = jax.process_index() == 0
    tmp = None
    if writer:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.tmp-")
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for file, group in zip(names, groups, strict=True):
            tensors_out = {}
            for i in group:
                t, name, at = entries[i]
                x = _to_hf(t, _host_tensor(leaves[t.path], at), np_dtype if t.collection == "params" else np.float32)
                tensors_out[name] = x
                weight_map[name] = file
                total += x.nbytes
            if tmp is not None:
                save_file(tensors_out, os.path.join(tmp, file), metadata={"format": "pt"})
            del tensors_out
        if tmp is not None:
            if len(names) > 1:
                with open(os.path.join(tmp, INDEX), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config_to_hf(cfg, dtype), f, indent=2)
            _replace_dir(tmp, out)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("zjax.hf.save")
    return out


def _replace_dir(new: str, out: str) -> None:
    """Move the complete ``new`` to ``out``; an existing ``out`` is removed only after the move."""
    if not os.path.exists(out):
        os.rename(new, out)
        return
    old = f"{out}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
