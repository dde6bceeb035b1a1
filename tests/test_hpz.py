"""ZeRO++'s hpZ (``Plan(hpz=True)``): stage 3's state over ``replica x dp``, the per-layer gathers inside a node."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax.models import Decoder, DecoderConfig, lm_loss
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives, spanned_axes

from .test_gpu_plan import _figure

CFG = DecoderConfig(vocab=256, embed=128, layers=2, heads=4, head_dim=32, mlp=512, max_len=32)
TOKENS = np.random.RandomState(0).randint(0, CFG.vocab, (8, CFG.max_len + 1)).astype(np.int32)


def _decoder_step(hpz: bool, precision: str = "bf16", quantized_comm: str | None = None, mesh_shape=None, **plan_kw):
    model = Decoder(CFG)
    mesh = zjax.make_mesh(**(mesh_shape or {}), dp=(2, 4 // (mesh_shape or {}).get("pp", 1)))
    plan = zjax.Plan(mesh, stage=3, precision=precision, hpz=hpz, quantized_comm=quantized_comm, **plan_kw)
    init = lambda r: model.init(r, jnp.zeros((1, CFG.max_len), jnp.int32))["params"]  # noqa: E731
    state = plan.init(init, optax.adamw(1e-3), jax.random.key(0))
    return plan, state, plan.train_step(lambda p, b: lm_loss(model, p, b)), plan.shard_batch(TOKENS)


@pytest.mark.slow  # four Decoder compiles; the fast suite checks hpZ's layout and gathers
def test_hpz_splits_the_state_over_every_rank_gathers_across_nodes_once_and_trains_like_hsdp():
    """The Decoder on replica=2 x dp=4 in fp32 (so that only the order of sums differs): with hpZ the state is
    half HSDP's (split over 8 ranks, not 4), the parameters cross ``replica`` once per step (before the layer
    loop), every gather inside the loop stays within ``dp``, and the losses and weights are HSDP's."""
    model = Decoder(CFG)
    runs = {}
    for hpz in (False, True):
        plan = zjax.Plan(zjax.make_mesh(dp=(2, 4)), stage=3, precision="fp32", hpz=hpz)
        init = lambda r: model.init(r, jnp.zeros((1, CFG.max_len), jnp.int32))["params"]  # noqa: E731
        # SGD, not Adam: Adam's first steps move each weight by about lr * sign(gradient), so a gradient within
        # rounding of zero (summed in another order) moves its weight by a different lr-sized step on another CPU
        state = plan.init(init, optax.sgd(0.1), jax.random.key(0))
        step, batch = plan.train_step(lambda p, b: lm_loss(model, p, b)), plan.shard_batch(TOKENS)
        held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
        compiled, hlo = partitioned_hlo(step.lower(state, batch))  # the program the step runs, compiled once
        gathers = [
            (c.in_loop, spanned_axes(c.groups, dict(plan.mesh.shape)), c.volume * c.trips)
            for c in collectives(hlo)
            if c.kind == "all-gather"
        ]
        losses = []
        for _ in range(3):
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
        runs[hpz] = (held, gathers, losses, jax.device_get(state.params))
    (hsdp, hsdp_gathers, hsdp_losses, hsdp_params), (held, gathers, losses, params) = runs[False], runs[True]
    assert held * 2 == hsdp  # the fp32 parameters per device (and the optimizer's, laid out alike)
    in_loop = {axes for loop, axes, _ in gathers if loop}
    assert in_loop == {("dp",)}, gathers
    across = sum(v for loop, axes, v in gathers if not loop and axes == ("replica",))
    assert across > 0 and not any(loop for loop, axes, _ in hsdp_gathers if "replica" in axes)
    np.testing.assert_allclose(losses, hsdp_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(hsdp_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


def test_hpz_is_refused_where_it_cannot_run():
    mesh = zjax.make_mesh(dp=(2, 4))
    for kwargs, problem in (
        ({"mesh": zjax.make_mesh(dp=8), "stage": 3}, "replica=1"),
        ({"mesh": mesh, "stage": 2}, "stage 2"),
        ({"mesh": mesh, "stage": 3, "offload": "optimizer"}, "offload='optimizer'"),
    ):
        with pytest.raises(ValueError, match=f"hpz=True .*not with {problem}"):
            zjax.Plan(hpz=True, **kwargs)
    with pytest.raises(TypeError, match="hpz must be True or False"):
        zjax.Plan(mesh, stage=3, hpz=1)


def test_llama2_7b_on_8_nodes_keeps_its_layer_gathers_inside_the_nodes():
    """The issue's cost, read from the figure on docs/concepts/quantized_comm.md (recomputed in CI): Llama-2-7B on
    replica=8 x dp=8 H100s at stage 3. hpZ holds ZeRO-3's state over all 64 GPUs (1/8 of HSDP's); its bytes that
    cross nodes are the node shards' gather once per step plus the gradients' reduce-scatter, so the per-layer
    weight gathers (forward and recompute: 2 x 7/8 of the bf16 parameters) stay inside the nodes."""
    text = _figure("docs/concepts/quantized_comm.md", "--hpz no,yes")
    rows = {}  # hpz (yes/no) -> (state, total, comm, exposed, x-replica) in GB
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) == 4 and cells[0].split()[:3] == ["3", "full", "1"]:
            state, _, total = (float(x) for x in cells[2].split())
            comm, _, _, exposed, _, across = cells[3].split()
            rows[cells[0].split()[3]] = (state, total, float(comm), float(exposed), float(across))
    assert set(rows) == {"yes", "no"}, text
    psi = 6_738_415_616
    assert rows["yes"][0] == pytest.approx(14 * psi / 64 / 1e9, abs=1e-3)
    assert rows["no"][0] == pytest.approx(14 * psi / 8 / 1e9, abs=1e-3)
    inside = rows["yes"][2] - rows["yes"][4]
    assert inside >= 2 * (7 / 8) * 2 * psi / 8 / 1e9  # every layer's gathers over dp, twice per step


def _moved(plan, hlo) -> Counter:
    """Bytes each step's collectives move, by (kind, dtype, in a loop, mesh axes spanned)."""
    out: Counter = Counter()
    for c in collectives(hlo):
        out[c.kind, c.dtype, c.in_loop, spanned_axes(c.groups, dict(plan.mesh.shape))] += c.volume * c.trips
    return out


@pytest.mark.slow  # a Decoder compile under 1F1B
def test_hpz_under_a_table_schedule_crosses_nodes_once_and_gathers_each_layer_inside_the_node():
    """hpZ with qwZ under 1F1B (stage 3's per-layer gathers in the tick loop), replica=2 x dp=2 x pp=2: the parameters
    cross ``replica`` once per step as int8, before the loop; every gather inside the loop runs over ``dp`` alone, in
    bf16 (the node's shards are bf16 once across). The numbers: tests/test_pipeline_objective.py's hpz case."""
    pipe = zjax.Pipeline(2, schedule="1f1b")
    plan, state, step, batch = _decoder_step(True, quantized_comm="weights", pipeline=pipe, mesh_shape={"pp": 2})
    moved = _moved(plan, partitioned_hlo(step.lower(state, batch))[1])
    gathers = {(d, loop, axes) for (k, d, loop, axes) in moved if k == "all-gather"}
    assert ("s8", False, ("replica",)) in gathers, gathers
    assert {axes for _, loop, axes in gathers if loop} == {("dp",)}, gathers
    assert {d for d, loop, _ in gathers if loop} == {"bf16"}, gathers


@pytest.mark.slow  # two Decoder compiles and runs
def test_hpz_reduces_in_fp32_inside_the_node_and_across_nodes_as_hsdp_does():
    """``reduce_dtype=float32`` with hpZ: each layer's gradient is reduce-scattered over ``dp`` in fp32 and the
    node shard's over ``replica`` too, while the weights still cross ``replica`` in bf16; the step after the
    first update follows HSDP's fp32 reduction (the same sums in another order: measured 5e-6 relative; a node
    shard's gradient rounded to bf16 between the two sums moves it by 7e-5)."""
    runs = {}
    for hpz in (False, True):
        plan, state, step, batch = _decoder_step(hpz, reduce_dtype="float32")
        compiled, hlo = partitioned_hlo(step.lower(state, batch))
        losses = []
        for _ in range(2):
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
        runs[hpz] = _moved(plan, hlo), losses
    moved: Counter = Counter()
    for (kind, dtype, _, axes), b in runs[True][0].items():  # in or out of loops
        moved[kind, dtype, axes] += b
    assert moved["reduce-scatter", "f32", ("dp",)] > 0 and moved["reduce-scatter", "f32", ("replica",)] > 0, moved
    assert not [key for key in moved if key[0] in ("reduce-scatter", "all-reduce") and key[1] == "bf16"], moved
    assert moved["all-gather", "bf16", ("replica",)] > 0 and moved["all-gather", "f32", ("replica",)] == 0, moved
    np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=2e-5)


@pytest.mark.slow  # three Decoder compiles and runs; the 7B figure tests read the same plans' bytes in the fast suite
def test_hpz_with_quantized_collectives_trains_like_hpz_and_cuts_the_bytes_across_nodes():
    """The Decoder on replica=2 x dp=4 with hpZ, in bf16 alone, with qwZ and with qwZ + qgZ (ZeRO++'s three), each
    program compiled once for its collectives and its three steps.

    hpZ: the state is split over all 8 ranks, the parameters cross ``replica`` before the layer loop, every gather
    inside it stays within ``dp``; a step of the HSDP plan refuses hpZ's state and names ``plan.reshard``.
    qwZ: the once-per-step gather across nodes moves int8 blocks with fp32 scales (no bf16 weights left on it but a
    few small leaves), about half of bf16 hpZ's gather bytes; the per-layer gathers inside the node stay over ``dp``.
    qwZ + qgZ: each layer's gradient is summed inside the node (an int8 all-to-all over ``dp``) and its node shard
    across nodes (an int8 all-to-all over ``replica``); the node shards cross ``replica`` as int8 once per
    microbatch; no collective spans nodes and GPUs at once but the loss's scalars, no gradient crosses in bf16, and
    the step moves about a fifth of hpZ's bytes across nodes (the gradients no longer reduce over all ranks at
    once). Three steps follow hpZ's bf16 losses within the blocks' rounding (measured: 1.1e-4 and 2.5e-4
    relative)."""
    runs = {}
    for q in (None, "weights", "weights+grads"):
        plan, state, step, batch = _decoder_step(True, quantized_comm=q)
        if q is None:
            held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
            assert held * 8 == sum(x.nbytes for x in jax.tree.leaves(state.params))  # every leaf split 8 ways
        node_shard = sum(x.size for x in jax.tree.leaves(state.params)) // 4  # parameters per node shard (dp=4)
        compiled, hlo = partitioned_hlo(step.lower(state, batch))
        moved = _moved(plan, hlo)
        across = (
            sum(b for key, b in moved.items() if key[0] == "all-gather" and key[3] == ("replica",)),
            sum(b for key, b in moved.items() if "replica" in key[3]),
        )
        losses = []
        for _ in range(3):
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
        if q is None:
            hsdp = zjax.Plan(plan.mesh, stage=3)  # the other layout: a step of one refuses a state of the other
            refused = "hpz=True, but this step's plan .* hpz=False; call state = plan.reshard"
            with pytest.raises(ValueError, match=refused):
                hsdp.train_step(lambda p, b: 0.0)(state, batch)
            assert hsdp.reshard(state).layout.params.hierarchical is False
        runs[q] = across, losses, moved, node_shard
    # hpZ alone: every gather inside the layer loop over dp, the parameters across replica outside it
    moved = runs[None][2]
    assert {axes for (k, _, loop, axes) in moved if k == "all-gather" and loop} == {("dp",)}, moved
    assert any(k == "all-gather" and not loop and axes == ("replica",) for (k, _, loop, axes) in moved), moved
    # qwZ
    moved = runs["weights"][2]
    gathered = {d: b for (k, d, loop, axes), b in moved.items() if k == "all-gather" and axes == ("replica",)}
    assert gathered.get("s8", 0) > 0 and "f32" in gathered, moved
    assert gathered.get("bf16", 0) < gathered["s8"] / 4, gathered  # measured: 16,384 bf16 bytes vs 147,616 int8
    assert {axes for (k, _, loop, axes) in moved if k == "all-gather" and loop} == {("dp",)}, moved
    # qwZ + qgZ: inside the node per layer (the layer loop); across nodes once per microbatch (one: no loop around it)
    moved, node_shard = runs["weights+grads"][2], runs["weights+grads"][3]
    assert moved["all-to-all", "s8", True, ("dp",)] > 0 and moved["all-to-all", "s8", False, ("replica",)] > 0, moved
    assert moved["all-gather", "s8", False, ("replica",)] > 0
    assert not [key for key in moved if key[2] and "replica" in key[3]], moved
    both = {key: b for key, b in moved.items() if key[3] == ("replica", "dp")}
    assert sum(both.values()) <= 128, both  # (the loss and the gradient norm)
    assert not [key for key in moved if key[0] in ("reduce-scatter", "all-to-all") and key[1] == "bf16"], moved
    # across nodes, each parameter's node shard twice, as int8 (its gather and its gradient's all-to-all, one byte
    # a value), and the scales (one fp32 per block of at most 256)
    crossing = sum(b for key, b in moved.items() if key[3] == ("replica",))
    assert 2 * node_shard <= crossing <= 2 * node_shard * 1.06, (crossing, node_shard)
    # the bytes across nodes against bf16 hpZ's, and the losses
    assert runs["weights"][0][0] < 0.6 * runs[None][0][0], runs  # the gather across nodes (measured 0.52x)
    assert runs["weights+grads"][0][1] < 0.3 * runs[None][0][1], runs  # all bytes across nodes (measured 0.22x)
    for q in ("weights", "weights+grads"):
        np.testing.assert_allclose(runs[q][1], runs[None][1], rtol=1e-3)


def test_llama2_7b_with_hpz_and_int8_gradients_keeps_a_tenth_of_its_bytes_across_nodes():
    """ZeRO++'s three on the figure (docs/concepts/quantized_comm.md, recomputed in CI): Llama-2-7B on replica=8 x
    dp=8 H100s. With int8 weights and gradients what crosses nodes is each node shard's gather and its gradient's
    all-to-all, one byte a value each (ZeRO counting: a node shard each) and a scale per 256 values, not the
    per-layer reduce-scatters over all 64 GPUs; the state is hpZ's either way."""
    text = _figure("docs/concepts/quantized_comm.md", "--hpz yes --quantize-comm none,weights,weights+grads")
    rows = {}  # wire dtypes -> (state, x-replica) in GB
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) == 4 and cells[0].split()[:3] == ["3", "full", "1"]:
            rows[cells[0].split()[3]] = (float(cells[2].split()[0]), float(cells[3].split()[-1]))
    assert set(rows) == {"bf16/bf16", "int8/bf16", "int8/int8"}, text
    psi = 6_738_415_616
    assert len({state for state, _ in rows.values()}) == 1
    assert rows["int8/bf16"][1] < rows["bf16/bf16"][1]
    node_shard = psi / 8  # parameters per node shard
    assert rows["int8/int8"][1] <= 2 * node_shard * (1 + 4 / 256) * 1.01 / 1e9, rows
    assert rows["int8/int8"][1] < rows["bf16/bf16"][1] / 8
