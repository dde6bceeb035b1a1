"""MXFP8 products: blocks of 32 with e8m0 scales, exact to the format's rounding on CPU, a Triton block-scaled GEMM
for every projection on the deviceless B200, and the refusals (a dim that is no multiple of 32, Hopper, many GPUs)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import zjax
from zjax.models import PRESETS, Decoder, lm_loss

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _qdq(x: np.ndarray, axis: int, dtype) -> np.ndarray:
    """MXFP8 in NumPy: blocks of 32 along ``axis``, each divided by its amax over the format's largest value rounded
    up to a power of two, rounded to the format and multiplied back (float64)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    top = float(ml_dtypes.finfo(dtype).max)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / top)), 1.0)
    q = (blocks / scale).astype(np.float32).astype(dtype).astype(np.float64) * scale
    return np.moveaxis(q.reshape(x.shape), -1, axis)


def test_the_products_are_the_blocks_rounded_operands_forward_and_backward():
    """Forward: blocks along the contraction; ``dx = g w^T`` with blocks along the output dim; ``dw = x^T g`` along
    the sequence. Each block's scale is its own: rows whose magnitudes differ by orders keep their digits."""
    rs = np.random.RandomState(0)
    x = (rs.randn(2, 32, 64) * np.where(rs.rand(2, 32, 1) < 0.5, 1e-5, 1.0)).astype(np.float32)  # some rows tiny
    w = (rs.randn(64, 4, 32) * 0.05).astype(np.float32)
    g = rs.randn(2, 32, 4, 32).astype(np.float32)

    @jax.jit
    def forward_and_back(x, w, g):
        y, vjp = jax.vjp(zjax.fp8.matmul_mx, x, w)
        return (y, *vjp(g))

    y, dx, dw = forward_and_back(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    want = {
        "y": np.einsum("bsk,khd->bshd", _qdq(x, -1, E4M3), _qdq(w, 0, E4M3)),
        "dx": np.einsum("bshd,khd->bsk", _qdq(g, -1, E5M2), _qdq(w, -1, E4M3)),
        "dw": np.einsum("bsk,bshd->khd", _qdq(x, 1, E4M3), _qdq(g, 1, E5M2)),
    }
    for name, got in (("y", y), ("dx", dx), ("dw", dw)):
        np.testing.assert_allclose(np.asarray(got), want[name], rtol=1e-5, atol=1e-6 * np.abs(want[name]).max())
    # one scale per tensor flushes the tiny rows to e4m3's subnormals and zero (its range: 2^-9 to 448); their own
    # blocks' scales keep their digits
    exact = np.einsum("bsk,khd->bshd", x, w)
    per_tensor = np.asarray(jax.jit(zjax.fp8.matmul)(jnp.asarray(x), jnp.asarray(w)))
    small = np.abs(x).max(axis=-1) < 1e-3 * np.abs(x).max()
    err = lambda got: np.linalg.norm((got - exact)[small]) / np.linalg.norm(exact[small])  # noqa: E731
    assert err(np.asarray(y)) < 0.1 and err(per_tensor) > 0.5, (err(np.asarray(y)), err(per_tensor))
    # two contracted dims (the attention's output projection): blocks along head_dim
    wo = rs.randn(4, 32, 64).astype(np.float32)
    got = jax.jit(lambda a, b: zjax.fp8.matmul_mx(a, b, contract=2))(jnp.asarray(g), jnp.asarray(wo))
    want_o = np.einsum("bshd,hde->bse", _qdq(g, -1, E4M3), _qdq(wo, 1, E4M3))
    np.testing.assert_allclose(np.asarray(got), want_o, rtol=1e-5, atol=1e-6 * np.abs(want_o).max())


def test_a_dim_that_is_no_multiple_of_the_block_names_the_parameter():
    model = Decoder(dataclasses.replace(PRESETS["tiny"], embed=48, matmul="mxfp8"))
    with pytest.raises(ValueError, match=r"zjax.fp8 \(layers/wq\): mxfp8 scales blocks of 32 values, and x "
                                         r"\(1, 64, 48\)'s last dim .* has 48"):  # fmt: skip
        jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32)))
    short = Decoder(dataclasses.replace(PRESETS["tiny"], matmul="mxfp8"))
    rows = jnp.zeros((2, 17), jnp.int32)  # a sequence of 17
    with pytest.raises(ValueError, match=r"dim 1 \(the rows' sequence.*has 17.*--seq-len"):
        jax.eval_shape(lambda: short.init(jax.random.key(0), rows))


def test_mxfp8_is_refused_before_blackwell_and_across_gpus():
    with pytest.raises(ValueError, match=r"'mxfp8' on h100 \(compute capability 9.0\).*Blackwell"):
        zjax.planner.estimate("tiny", mesh={"dp": 1}, batch_size=2, seq_len=64, target="h100", matmul="mxfp8")
    with pytest.raises(ValueError, match=r"'mxfp8' on 8 x b200.*cannot split XLA's block-scaled product"):
        zjax.planner.estimate("tiny", mesh={"dp": 8}, batch_size=8, seq_len=64, target="b200", matmul="mxfp8")
    zjax.fp8.check_device("mxfp8", "cpu", None, 8)  # the CPU computes MXFP8's numerics on any mesh
    zjax.fp8.check_device("fp8-current", "NVIDIA H100", (9, 0), 8)


@pytest.mark.slow  # two deviceless B200 compiles; the fast tests check the numerics and the refusals
def test_on_the_b200_target_every_projection_is_a_block_scaled_gemm():
    """One deviceless B200 (the only place jax 0.10's XLA compiles a block-scaled product: see above): each of a
    layer's seven projections runs as a ``scaled-dot`` (forward e4m3 x e4m3; backward e5m2 x e4m3 for dx and
    e4m3 x e5m2 for dw) inside a Triton GEMM fusion, the head stays bf16, and the timeline runs them at the fp8
    peak."""
    import optax

    from zjax.planner import count_gemms
    from zjax.planner._gpu import cudnn_for_target, gpu_devices
    from zjax.planner._targets import get_target
    from zjax.planner._timeline import LINKS, timeline

    def compile_step(matmul):
        cfg = dataclasses.replace(PRESETS["tiny"], matmul=matmul, remat="full")
        plan = zjax.Plan(zjax.make_mesh(dp=1, devices=gpu_devices("b200", 1)), stage=0, precision="bf16")
        model = Decoder(cfg)
        init = lambda r: model.init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]  # noqa: E731
        state = plan.abstract_state(init, optax.adamw(1e-3), jax.random.key(0))
        step = plan.train_step(lambda p, b: lm_loss(model, p, b))
        with cudnn_for_target("b200"):
            return cfg, step.lower(state, jax.ShapeDtypeStruct((8, cfg.max_len + 1), jnp.int32)).compile().as_text()

    cfg, hlo = compile_step("mxfp8")
    got = count_gemms(hlo)
    per_step = cfg.layers * 7
    assert got.get("f8e5m2 x f8e4m3fn") == per_step and got.get("f8e4m3fn x f8e5m2") == per_step, got
    assert per_step < got.get("f8e4m3fn x f8e4m3fn", 0) <= 2 * per_step, got  # forward and its recompute
    assert set(got) - {"f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2", "f8e4m3fn x f8e4m3fn"} == {"bf16 x bf16"}, got
    assert got["bf16 x bf16"] == 3, got  # the head's
    scaled = [line for line in hlo.splitlines() if " scaled-dot(" in line]
    assert len(scaled) >= 3 * 7 and all("f8e8m0fnu" in hlo for _ in scaled)
    assert hlo.count('"kind":"__triton_nested_gemm_fusion"') >= len(scaled)  # each inside a Triton GEMM fusion
    b200 = get_target("b200")
    _, plain = compile_step("default")
    times = [timeline(h, b200.peak_bf16_flops, 1e30, LINKS["h100"], fp8_flops=b200.peak_fp8_flops).compute
             for h in (plain, hlo)]  # fmt: skip
    assert 0.5 * times[0] < times[1] < 0.8 * times[0], times
