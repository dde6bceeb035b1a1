"""``zjax.hf.load``: a Hugging Face checkpoint into a plan's sharded layout, each process reading only its slices.

Every fp32 master leaf is made by ``jax.make_array_from_callback`` on its master sharding; the callback
reads, through ``safetensors``' lazy slices, exactly the rows and columns its device holds (a superset
only along a flattened head dimension), and of a mixture of experts' stacked experts only the experts its
device holds (one file tensor each). No device and no host holds a leaf that the plan shards; a process
holds on host at most the distinct shards of one leaf that its devices need.

An fp8 weight (DeepSeek-V3's published checkpoint: ``float8_e4m3fn`` with a ``<name>_scale_inv`` of one fp32 factor
per block of ``quantization_config.weight_block_size``, 128 x 128) is dequantised as it is read: each value times
its block's factor, in fp32, exactly.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._extras import require
from ..core import Plan, TrainState, Variables
from ..models import Decoder, DecoderConfig, config_from_hf
from ..models._hf_config import config_path, read_hf_config
from ._files import checkpoint_dir, weight_map
from ._names import IGNORED_SUFFIXES, Tensor, tensors

SCALE_SUFFIX = "_scale_inv"
"""A block-quantized fp8 weight's scales in the same files: ``<weight name>_scale_inv``, multiplied to dequantise."""

_COMPARED = (
    "vocab", "embed", "layers", "heads", "num_kv_heads", "head_dim", "tie_embeddings", "qkv_bias", "qk_norm", "mla",
    "dense_layers",
)  # fmt: skip


def _weight_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The settings that decide the parameters' names and shapes: with experts, ``mlp`` is theirs (a dense
    MLP's size that no layer uses does not count); ``experts`` is 0 for a dense model."""
    m = cfg.moe
    return {
        **{k: getattr(cfg, k) for k in _COMPARED},
        "mlp": cfg.mlp if m is None else m.expert_mlp(cfg.mlp),
        "experts": 0 if m is None else m.experts,
        "shared_mlp": 0 if m is None else m.shared_mlp,
    }


def _check_config(path: str, model: Decoder) -> None:
    file = config_path(path)
    found = _weight_fields(config_from_hf(read_hf_config(path), file))
    have = _weight_fields(model.cfg)
    diff = [f"{k}: model {have[k]}, checkpoint {found[k]}" for k in have if have[k] != found[k]]
    if diff:
        raise ValueError(
            f"zjax.hf.load: the model does not match {file}: {'; '.join(diff)}. Build the model with "
            f"zjax.models.from_hf_config({path!r})."
        )


def _check_names(directory: str, files: dict[str, str], specs: list[Tensor], cfg: DecoderConfig) -> None:
    expected = {n for t in specs for n in t.names()}
    # DeepSeek-V3's multi-token prediction modules are the num_nextn_predict_layers layers past num_hidden_layers,
    # which Hugging Face's model skips too: read only by a model with as many (DecoderConfig.mtp_layers)
    mtp = int(read_hf_config(directory).get("num_nextn_predict_layers") or 0)
    if cfg.mtp_layers > mtp:
        raise ValueError(
            f"zjax.hf.load: the model has mtp_layers={cfg.mtp_layers} but {directory!r}'s config.json has "
            f"num_nextn_predict_layers={mtp}: the files hold no weights for the other modules. Build the model "
            f"with mtp_layers <= {mtp}."
        )
    later = re.compile(r"model\.layers\.(\d+)\.")
    beyond = {
        n for n in files if (m := later.match(n)) and cfg.layers + cfg.mtp_layers <= int(m.group(1)) < cfg.layers + mtp
    }
    present = {
        n
        for n in files
        if not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and n == "lm_head.weight")
        and not (n.endswith(SCALE_SUFFIX) and n.removesuffix(SCALE_SUFFIX) in files)  # an fp8 weight's scales
    } - beyond
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        raise ValueError(
            f"zjax.hf.load: the tensors in {directory!r} do not match the model: "
            + (f"{len(missing)} missing {missing[:12]}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"{len(unexpected)} unexpected {unexpected[:12]}" if unexpected else "")
            + ". Check that config.json belongs to these weights."
        )


class _Reader:
    """Open safetensors files and slice tensors out of them, checking each tensor's shape once."""

    def __init__(self, files: dict[str, str], stack: contextlib.ExitStack, block: tuple[int, int] = (128, 128)):
        self._files, self._stack, self._block = files, stack, block
        self._open: dict[str, Any] = {}
        self._checked: set[str] = set()
        self._scales: dict[str, np.ndarray] = {}
        stack.enter_context(_numpy_names_fp8())

    def handle(self, name: str) -> Any:
        file = self._files[name]
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = self._stack.enter_context(safe_open(file, "numpy"))
        return self._open[file]

    def check(self, t: Tensor, name: str) -> None:
        if name in self._checked:
            return
        shape = tuple(self.handle(name).get_slice(name).get_shape())
        if shape != t.hf_shape:
            raise ValueError(
                f"zjax.hf.load: tensor {name!r} in {self._files[name]!r} has shape {shape}; the model's config "
                f"makes it {t.hf_shape} (zjax parameter {'/'.join(t.path)} {t.shape}). Check config.json."
            )
        self._checked.add(name)

    def read(self, t: Tensor, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The zjax-layout block ``index`` (normalized slices over ``t.shape``) of tensor ``name``, fp32."""
        self.check(t, name)
        ranges, blocks = [], []
        for group in t.hf_dims:  # each Hugging Face dim: a contiguous range covering the block
            first, rest = index[group[0]], math.prod(t.shape[d] for d in group[1:])
            ranges.append(slice(first.start * rest, first.stop * rest))
            blocks += [first.stop - first.start, *(t.shape[d] for d in group[1:])]
        part = self.handle(name).get_slice(name)
        x = part[tuple(ranges)]
        if part.get_dtype().startswith("F8"):
            x = self._dequantised(name, x, ranges)
        x = x.reshape(blocks)
        order = [d for group in t.hf_dims for d in group]
        x = x[tuple(slice(None) if d in {g[0] for g in t.hf_dims} else index[d] for d in order)]
        return np.ascontiguousarray(x.transpose(np.argsort(order)), dtype=np.float32)

    def _dequantised(self, name: str, x: np.ndarray, ranges: list[slice]) -> np.ndarray:
        """The fp8 slice ``x`` (``ranges`` of tensor ``name``) times its blocks' factors, fp32."""
        scale = name + SCALE_SUFFIX
        if scale not in self._files:
            raise ValueError(
                f"zjax.hf.load: tensor {name!r} in {self._files[name]!r} is fp8 without its block scales "
                f"{scale!r}; an fp8 checkpoint keeps one per block (DeepSeek-V3's layout). Convert it to bf16 "
                "first, or add the scales."
            )
        if scale not in self._scales:
            self._scales[scale] = np.asarray(self.handle(scale).get_tensor(scale), np.float32)
        factors = self._scales[scale]
        if len(ranges) != 2 or factors.ndim != 2:
            raise ValueError(f"zjax.hf.load: fp8 tensor {name!r} has {len(ranges)} dims; block scales are 2-D.")
        rows, cols = (np.arange(r.start, r.stop) // b for r, b in zip(ranges, self._block, strict=True))
        if rows.max(initial=0) >= factors.shape[0] or cols.max(initial=0) >= factors.shape[1]:
            raise ValueError(
                f"zjax.hf.load: {scale!r} {factors.shape} does not cover {name!r} in blocks of {self._block} "
                "(quantization_config.weight_block_size); check config.json."
            )
        return x.astype(np.float32) * factors[np.ix_(rows, cols)]


@contextlib.contextmanager
def _numpy_names_fp8():
    """safetensors' NumPy reader finds the fp8 dtypes as ``numpy`` attributes, which NumPy lacks: ml_dtypes' while
    a checkpoint is read (the names removed after)."""
    import ml_dtypes

    added = [n for n in ("float8_e4m3fn", "float8_e5m2") if not hasattr(np, n)]
    for n in added:
        setattr(np, n, getattr(ml_dtypes, n))
    try:
        yield
    finally:
        for n in added:
            delattr(np, n)


def _leaf(reader: _Reader, t: Tensor, shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> jax.Array:
    cache: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    lead = len(shape) - len(t.shape)  # the layers and experts axes: one file tensor per index

    def block(index: tuple[slice, ...] | None) -> np.ndarray:
        index = tuple(slice(None) for _ in shape) if index is None else index
        norm = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        key = tuple((s.start, s.stop) for s in norm)
        if key not in cache:  # replicas of a block share one host copy
            if not lead:
                cache[key] = reader.read(t, t.name, norm)
            else:
                out = np.empty(tuple(s.stop - s.start for s in norm), np.float32)
                for at in itertools.product(*(range(s.start, s.stop) for s in norm[:lead])):
                    rel = tuple(a - s.start for a, s in zip(at, norm, strict=False))
                    out[rel] = reader.read(t, t.name_at(at), norm[lead:])
                cache[key] = out
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, block)


def load(
    path: str | os.PathLike,
    plan: Plan,
    model: Decoder,
    tx: Any,
    rng: jax.Array | None = None,
) -> TrainState:
    """A :class:`~zjax.TrainState` in ``plan``'s layout whose weights are the Hugging Face checkpoint's.

    Args:
      path: the checkpoint directory (``config.json`` plus ``model.safetensors`` or a sharded index), or
        its ``config.json``.
      plan: where the state lives (any stage, mesh and pipeline).
      model: a :class:`~zjax.models.Decoder` of the checkpoint's architecture
        (:func:`zjax.models.from_hf_config`).
      tx: the optax transformation; its state starts at zero, as for a fresh run.
      rng: the state's key (``jax.random.key(0)`` by default).

    The fp32 master weights are the checkpoint's values exactly (bf16 and fp16 widen losslessly); the
    compute copy is cast from them. Each process reads only the slices its devices hold.

    Raises:
      ValueError: an unsupported ``model_type``, a model that does not match ``config.json``, missing or
        unexpected tensors (listed), a tensor whose shape disagrees with the config.
      FileNotFoundError: no ``config.json`` or no safetensors weights.
    """
    require("safetensors", "zjax.hf.load")
    directory = checkpoint_dir(path)
    rng = jax.random.key(0) if rng is None else rng
    if not isinstance(model, Decoder):
        raise TypeError(f"zjax.hf.load: model must be a zjax.models.Decoder, got {type(model).__name__}.")
    _check_config(directory, model)
    cfg = model.cfg
    files = weight_map(directory)
    specs = list(tensors(cfg))
    _check_names(directory, files, specs, cfg)

    stored_state = any(t.collection != "params" for t in specs)
    keeps_state = stored_state or cfg.keeps_state  # fp8 amax histories: model state no file holds

    def init_fn(r):
        variables = model.init(r, jnp.zeros((1, min(8, cfg.max_len)), jnp.int32))
        return Variables.linen(variables) if keeps_state else variables["params"]

    abstract = plan.abstract_state(init_fn, tx, rng)
    target = abstract.params if abstract.opt_state.master is None else abstract.opt_state.master
    by_path: dict[tuple[str, ...], Tensor] = {}
    for t in specs:  # a leaf some files hold twice (MTP's copies of the embedding and head) is read from the first
        by_path.setdefault(t.path, t)
    with contextlib.ExitStack() as stack:
        quantized = read_hf_config(directory).get("quantization_config") or {}
        reader = _Reader(files, stack, tuple(quantized.get("weight_block_size") or (128, 128)))  # type: ignore[arg-type]

        def make(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
            keys = tuple(str(getattr(k, "key", k)) for k in path)
            return _leaf(reader, by_path[keys], tuple(leaf.shape), leaf.sharding)

        def state_leaf(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
            if tuple(str(getattr(k, "key", k)) for k in path) in by_path:
                return make(path, leaf)
            zeros = np.zeros(leaf.shape, leaf.dtype)  # what no file holds (fp8 amax histories) starts empty
            return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: zeros[index])

        master = jax.tree_util.tree_map_with_path(make, target)
        # the routers' selection biases (DeepSeek's e_score_correction_bias), in the state's layout
        model_state = jax.tree_util.tree_map_with_path(state_leaf, abstract.model_state) if keeps_state else None
    state = plan._init(init_fn, tx, rng, master, donate=True)
    return state if model_state is None else state.replace(model_state=model_state)
