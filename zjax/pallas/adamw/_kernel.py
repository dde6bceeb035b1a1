"""The fused AdamW Pallas kernel: one pass over grad, master, m, v; writes master, m, v and the compute copy.

Inputs and outputs are flat 1-D arrays; each program handles ``block_size`` elements with masked loads and
stores, so any length works. master, m and v are updated in place (``input_output_aliases``). Per
element it moves ``grad + 3 x 4`` bytes in and ``3 x 4 + compute`` bytes out: 28 for bf16 grads and
compute copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import compiler_params, load, store
from ._config import FusedAdamWConfig
from ._reference import adamw_math

NUM_SCALARS = 16
_MAX_OFFSET = 2**31 - 1  # program_id * block_size and the element index are int32 inside one launch


def _kernel(s_ref, g_ref, p_ref, m_ref, v_ref, p_out, m_out, v_out, c_out, *, n: int, block: int):
    start = pl.program_id(0) * block
    idx = pl.ds(start, block)
    mask = start + jnp.arange(block) < n
    s = tuple(s_ref[i] for i in range(9))
    g = load(g_ref.at[idx], mask).astype(jnp.float32)
    p = load(p_ref.at[idx], mask)
    m = load(m_ref.at[idx], mask)
    v = load(v_ref.at[idx], mask)
    p_new, m_new, v_new = adamw_math(s, g, p, m, v)
    store(p_out.at[idx], p_new, mask)
    store(m_out.at[idx], m_new, mask)
    store(v_out.at[idx], v_new, mask)
    store(c_out.at[idx], p_new.astype(c_out.dtype), mask)


def adamw_kernel(scalars, grad, master, m, v, compute_dtype, config: FusedAdamWConfig, interpret: bool = False):
    """Run the kernel on flat arrays: ``(new_master, new_m, new_v, new_compute)``.

    The kernel's offsets are int32. A shard longer than that runs as consecutive pieces, one launch each,
    whose outputs are concatenated: correct at any length, at the price of copying that leaf's state once
    more (slices in, concatenation out); shard such a leaf further where memory is tight.
    """
    n = master.shape[0]
    block = config.block_size
    piece = (_MAX_OFFSET - block) // block * block  # the longest run whose offsets stay int32
    if n <= piece:
        return _launch(scalars, grad, master, m, v, compute_dtype, config, interpret)
    outs = []
    for start in range(0, n, piece):
        g_, p_, m_, v_ = (x[start : start + piece] for x in (grad, master, m, v))
        outs.append(_launch(scalars, g_, p_, m_, v_, compute_dtype, config, interpret))
    return tuple(jnp.concatenate(parts) for parts in zip(*outs, strict=True))


def _launch(scalars, grad, master, m, v, compute_dtype, config: FusedAdamWConfig, interpret: bool):
    n = master.shape[0]
    block = config.block_size
    f32 = jax.ShapeDtypeStruct((n,), jnp.float32)
    call = pl.pallas_call(
        functools.partial(_kernel, n=n, block=block),
        out_shape=(f32, f32, f32, jax.ShapeDtypeStruct((n,), compute_dtype)),
        grid=(pl.cdiv(n, block),),
        input_output_aliases={2: 0, 3: 1, 4: 2},
        interpret=interpret,
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        name="zjax_fused_adamw",
    )
    return call(scalars, grad, master, m, v)
