"""The one-pass quantization kernel: the XLA path's integers and scales, bit for bit (interpret mode), and the
GPU compile of ``zjax.comm.quantize`` runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from zjax import comm
from zjax.pallas import quantize as kernel


def _values(n_rows=48, n=512, seed=0):
    """Values over several orders of magnitude, a NaN and an inf in blocks of their own, a zero block."""
    rs = np.random.RandomState(seed)
    x = rs.randn(n_rows, n) * np.exp(rs.randn(n_rows, n))
    x[3, 5], x[7, n - 3], x[9, :256] = np.nan, np.inf, 0.0
    x[11, :256] = np.clip(x[11, :256], -100, 100)
    x[11, :4] = 127.0, 2.5, 3.5, -2.5  # a scale of 1: half-way points, which go to the even integer
    return x.astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("blocks", [1, 8, 64])  # 96 blocks: 64 per program does not divide them, 32 does
def test_the_kernel_makes_the_xla_paths_integers_and_scales(dtype, bits, blocks):
    x = jnp.asarray(_values(), dtype)
    q, scale = kernel.quantize_blocks(x, 256, bits, kernel.QuantizeConfig(blocks), interpret=True)
    want_q, want_scale = comm.quantize(x, 256, bits, kernel=False)
    assert (q.dtype, q.shape) == (want_q.dtype, want_q.shape)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(want_scale))  # NaN where a block held inf or NaN
    assert np.isnan(np.asarray(scale)[[3, 7], [0, 1]]).all() and np.asarray(scale)[9, 0] == 1.0
    if bits == 8:
        assert np.asarray(q)[11, :4].tolist() == [127, 2, 4, -2]


def test_a_nan_keeps_its_blocks_scale_non_finite_on_every_path():
    """XLA:CPU's vectorized maximum dropped a NaN in a [48, 2, 256] reduction: the block came out finite and
    its NaN quantized to 0, which hides a non-finite gradient from loss scaling."""
    x = jnp.asarray(np.random.RandomState(0).randn(48, 512).astype(np.float32)).at[3, 5].set(jnp.nan)
    for fn in (jax.jit(lambda v: comm.quantize(v, kernel=False)), comm.quantize):
        scale = np.asarray(fn(x)[1])
        assert np.isnan(scale[3, 0]) and np.isfinite(np.delete(scale.reshape(-1), 6)).all()


def test_a_gpu_compile_quantizes_through_the_kernel_and_a_cpu_compile_through_xla():
    from zjax.core._overlap import DEVICELESS
    from zjax.planner._gpu import cudnn_for_target, gpu_devices

    def compiled_text(fn, x):
        with cudnn_for_target("h100"):
            return jax.jit(fn).lower(x).compile(compiler_options=DEVICELESS).as_text()

    on_gpu = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=SingleDeviceSharding(gpu_devices("h100", 1)[0]))
    assert kernel.TRITON_NAME in compiled_text(comm.quantize, on_gpu)
    assert kernel.TRITON_NAME not in compiled_text(lambda v: comm.quantize(v, kernel=False), on_gpu)
    # a block the kernel does not take (not a power of two): XLA's fusions there too
    odd = jax.ShapeDtypeStruct((64, 480), jnp.bfloat16, sharding=on_gpu.sharding)
    assert kernel.TRITON_NAME not in compiled_text(lambda v: comm.quantize(v, 96), odd)
    assert kernel.TRITON_NAME not in jax.jit(comm.quantize).lower(jnp.ones((64, 512))).compile().as_text()


def test_the_kernel_refuses_blocks_it_cannot_tile():
    with pytest.raises(ValueError, match="last dim of 480 in blocks of 96.*power-of-two block"):
        kernel.quantize_blocks(jnp.ones((4, 480)), 96, 8)
    with pytest.raises(ValueError, match="blocks=3 must be a power of two"):
        kernel.QuantizeConfig(blocks=3)
