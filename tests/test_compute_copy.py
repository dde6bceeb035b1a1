"""Stage 3 without a compute copy (``Plan(compute_copy=False)``): the fp32 weights alone, cast before each gather."""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax.core._memory import theory_bytes
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives, spanned_axes

from ._models import linen_mlp_task, regression_batch

CFG = DecoderConfig(vocab=256, embed=128, layers=2, heads=4, head_dim=32, mlp=512, max_len=32)
TOKENS = np.random.RandomState(0).randint(0, CFG.vocab, (8, CFG.max_len + 1)).astype(np.int32)


def _state_bytes(state) -> int:
    """The persistent state one device holds (its shard of every leaf)."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))


def _run(copy: bool, quantized: str | None):
    model = Decoder(CFG)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, compute_copy=copy, quantized_comm=quantized)
    loss = lambda p, b: lm_loss(model, p, b)  # noqa: E731
    state = plan.init(
        lambda r: model.init(r, jnp.zeros((1, CFG.max_len), jnp.int32))["params"], optax.adamw(1e-3), jax.random.key(0)
    )
    step, batch = plan.train_step(loss), plan.shard_batch(TOKENS)
    sizes = _state_bytes(state), theory_bytes(state, plan.precision)[1]
    compiled = step.lower(state, batch).compile()
    losses = []
    for _ in range(2):
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return state, sizes, losses


@pytest.mark.slow  # four Decoder compiles; the fast suite trains the linen MLP both ways
@pytest.mark.codegen  # with LLVM's optimizations off 1.5% of the weights differ by up to 3.5e-4 after 3 steps
@pytest.mark.parametrize("quantized", [None, "weights+grads"], ids=["bf16", "int8"])
def test_without_a_compute_copy_the_state_holds_12_bytes_per_parameter_and_trains_the_same(quantized):
    """The Decoder on dp=8 at stage 3, with and without the copy: the state is 2 bytes per parameter per rank
    smaller (the bf16 copy), ``state.params`` are the fp32 weights, and the losses and weights are the ones the
    copy gives (the same bf16 values reach the model: cast at the end of a step or at the start of the next)."""
    kept, (kept_bytes, _), kept_losses = _run(True, quantized)
    state, (held, theory), losses = _run(False, quantized)
    psi, ranks = sum(x.size for x in jax.tree.leaves(state.params)), 8  # every dim of CFG divides by 8
    assert kept_bytes - held == 2 * psi // ranks
    assert theory["params"] == 4 * psi // ranks and theory["master"] == 0
    assert state.opt_state.master is None
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(losses, kept_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(kept.master_params), jax.tree.leaves(state.master_params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)


# per-layer gathers under GPipe: each layer's cast shard read inside the loop (without a pipeline stage 3 without
# the copy computes the one-device objective: tests/test_objective.py's bf16-no-compute-copy)
@pytest.mark.slow  # four pipelined Decoder compiles; the fast suite trains the linen MLP both ways
@pytest.mark.parametrize(("gather", "schedule"), [("layer", "gpipe")])
def test_under_a_pipeline_the_stages_read_the_cast_shards_as_they_would_the_copy(gather, schedule):
    """Stage 3 on dp=2 x pp=4 in the given gathering mode (layer: the default): without the copy the state is its bf16
    bytes smaller, every collective moves what it moved with the copy, and two steps give the same losses."""
    model = Decoder(dataclasses.replace(CFG, layers=4))
    init = lambda r: model.init(r, jnp.zeros((1, CFG.max_len), jnp.int32))["params"]  # noqa: E731
    runs = {}
    for copy in (True, False):
        pipe = zjax.Pipeline(8, zero3_gather=gather, schedule=schedule)
        plan = zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, compute_copy=copy, pipeline=pipe)
        state = plan.init(init, optax.adamw(1e-3), jax.random.key(0))
        held = _state_bytes(state)
        copied = _state_bytes(state.params) if copy else 0  # the bf16 copy a device holds
        batch = plan.shard_batch(np.tile(TOKENS, (4, 1)))
        compiled, hlo = partitioned_hlo(plan.train_step(lambda p, b: lm_loss(model, p, b)).lower(state, batch))
        moved = Counter()
        for c in collectives(hlo):
            moved[c.kind, c.dtypes, spanned_axes(c.groups, dict(plan.mesh.shape))] += c.volume * c.trips
        losses = []
        for _ in range(2):
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
        runs[copy] = held, copied, moved, losses
    (kept, copied, moved, losses), (held, _, moved_now, losses_now) = runs[True], runs[False]
    assert copied > 0 and kept - held == copied
    assert moved_now == moved and any(k[1] == ("bf16",) and k[0] == "all-gather" for k in moved)
    np.testing.assert_allclose(losses_now, losses, rtol=1e-6)


def _equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_reshard_and_checkpoints_move_a_state_between_the_forms(tmp_path):
    """A state with the copy becomes one without (its master becomes ``state.params``) and back (the cast is the
    copy again), by ``plan.reshard`` and by a checkpoint restored into the other form, at another stage too; a
    step refuses a state of the other form with the fix."""
    init_fn, loss_fn = linen_mlp_task()
    mesh, tx = zjax.make_mesh(dp=8), optax.adamw(1e-2)
    keep = zjax.Plan(mesh, stage=3)
    drop = zjax.Plan(mesh, stage=3, compute_copy=False)
    state, _ = keep.train_step(loss_fn)(keep.init(init_fn, tx, jax.random.key(0)), keep.shard_batch(regression_batch()))
    master = jax.device_get(state.opt_state.master)

    dropped = drop.reshard(state)
    assert dropped.opt_state.master is None and dropped.layout.master is False
    _equal(dropped.params, master)
    with pytest.raises(ValueError, match="compute copy.*plan.reshard"):
        keep.train_step(loss_fn)(dropped, keep.shard_batch(regression_batch()))
    back = keep.reshard(dropped)
    _equal(back.opt_state.master, master)
    _equal(back.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), master))

    stage_1 = zjax.Plan(mesh, stage=1)
    with zjax.Checkpointer(tmp_path / "dropped") as ckpt:
        ckpt.save(dropped, drop)
    with zjax.Checkpointer(tmp_path / "dropped") as ckpt:
        restored, _ = ckpt.restore(stage_1, init_fn, tx, jax.random.key(0))
    _equal(restored.opt_state.master, master)
    _equal(restored.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), master))
    _equal(restored.opt_state.inner, dropped.opt_state.inner)
    restored.layout.check(restored)  # placed as stage 1 lays it out
    with zjax.Checkpointer(tmp_path / "kept") as ckpt:
        ckpt.save(back, keep)
    with zjax.Checkpointer(tmp_path / "kept") as ckpt:
        restored, _ = ckpt.restore(drop, init_fn, tx, jax.random.key(0))
    assert restored.opt_state.master is None
    _equal(restored.params, master)
    step = drop.train_step(loss_fn)  # and it trains on
    assert np.isfinite(float(step(restored, drop.shard_batch(regression_batch()))[1]["loss"]))


def test_compute_copy_false_needs_stage_3_on_the_device():
    mesh = zjax.make_mesh(dp=8)
    with pytest.raises(ValueError, match="compute_copy=False.*stage 2"):
        zjax.Plan(mesh, stage=2, compute_copy=False)
    with pytest.raises(ValueError, match="compute_copy=False.*offload='optimizer'"):
        zjax.Plan(mesh, stage=3, compute_copy=False, offload="optimizer")
    with pytest.raises(TypeError, match="compute_copy must be True or False"):
        zjax.Plan(mesh, stage=3, compute_copy="no")
    # fp32 keeps no copy to drop: the flag changes nothing
    init_fn, _ = linen_mlp_task()
    state = zjax.Plan(mesh, stage=3, precision="fp32", compute_copy=False).init(
        init_fn, optax.sgd(0.1), jax.random.key(0)
    )
    assert state.opt_state.master is None and state.layout.master is False


@pytest.mark.codegen  # with LLVM's optimizations off the losses differ by 2.5e-5 relative after 3 steps
def test_a_model_without_gathered_reads_trains_without_a_copy():
    """A linen MLP that knows nothing of zjax.comm: its cast parameters are gathered by GSPMD where used, the state
    is 2 bytes per parameter per rank smaller, and the steps and the evaluation (which casts them too) equal the
    copy's."""
    init_fn, loss_fn = linen_mlp_task()
    out, held = [], []
    for copy in (True, False):
        plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, compute_copy=copy)
        state = plan.init(init_fn, optax.adamw(1e-2), jax.random.key(0))
        held.append(_state_bytes(state))
        step, batch = plan.train_step(loss_fn), plan.shard_batch(regression_batch())
        for _ in range(3):
            state, metrics = step(state, batch)
        evaluated = float(plan.eval_step(loss_fn)(state, batch))
        out.append((float(metrics["loss"]), jax.device_get(state.master_params), evaluated))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    assert out[0][2] == pytest.approx(out[1][2], rel=1e-6)
    psi = sum(x.size for x in jax.tree.leaves(state.params))  # every dim divides by 8: shards are exact
    assert held[0] - held[1] == 2 * psi // 8
    assert theory_bytes(state, plan.precision)[1]["params"] == 4 * psi // 8 and state.opt_state.master is None
    for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1]), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
