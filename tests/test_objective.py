"""One objective on every path: a step's loss and gradients are the one-device model's, however zjax reduces them.

Every case runs one SGD step (learning rate 1) of the tiny decoder on 8 simulated devices, on a batch whose rows
score different numbers of tokens and hold packed documents, and compares the gradient it applied with
``jax.grad`` of the whole batch's mean token loss in one plain ``jax.jit`` on one device (tests/_objective.py).
fp32 paths agree within 3e-5 (the reduction order alone costs about 6e-6 here); bf16 paths are held to the fp32
reference within 3e-2, qgZ's int8 gradients within 6e-2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zjax
from zjax.models import Decoder, lm_loss
from zjax.planner._compile import compiled_here

from ._models import TINY
from ._objective import SGD, applied, init_fn, initial, reference, relative, uneven_batch

ROWS = 32  # 8 data-parallel ranks x 4 microbatches
FP32, BF16, QGZ = 3e-5, 3e-2, 6e-2


@dataclasses.dataclass(frozen=True)
class Case:
    mesh: dict
    plan: dict
    accum: int = 1
    tolerance: float = FP32
    context_mode: str | None = None
    slow: bool = False  # a path another fast case takes too (the same function, other options)


CASES = {
    "stage0": Case({"dp": 8}, {"stage": 0}),
    # stage 1 is no path of its own: without accumulation it compiles to stage 2's program, with accumulation it
    # takes stage 0's per-rank region (stage0-accum4); docs/concepts/objective.md's first block runs it (accum 2)
    "stage2": Case({"dp": 8}, {"stage": 2}),
    "stage3": Case({"dp": 8}, {"stage": 3}),
    # accumulation at stage 0 reduces once per step in zjax's region; at stage 2 GSPMD reduces per microbatch
    "stage0-accum4": Case({"dp": 8}, {"stage": 0}, accum=4),
    "stage2-accum4": Case({"dp": 8}, {"stage": 2}, accum=4),
    "stage3-accum4": Case({"dp": 8}, {"stage": 3}, accum=4, slow=True),
    "offload": Case({"dp": 8}, {"stage": 2, "offload": "optimizer"}),
    "hpz": Case({"dp": (2, 4)}, {"stage": 3, "hpz": True}, slow=True),  # bf16-hpz below is fast
    "hsdp": Case({"dp": (2, 4)}, {"stage": 3}),  # replica=2 x dp=4
    "dp4-tp2": Case({"dp": 4, "tp": 2}, {"stage": 3}),
    "dp2-cp4-ring": Case({"dp": 2, "cp": 4}, {"stage": 3}, context_mode="ring"),
    # all-gather attention fast on cp=4 x tp=2 below
    "dp2-cp4-all-gather": Case({"dp": 2, "cp": 4}, {"stage": 3}, context_mode="all-gather", slow=True),
    "cp4-tp2": Case({"cp": 4, "tp": 2}, {"stage": 3}, context_mode="all-gather"),
    # every schedule at every stage: tests/test_pipeline_objective.py
    "dp4-pp2-gpipe": Case({"dp": 4, "pp": 2}, {"stage": 1, "pipeline": zjax.Pipeline(4)}),
    "dp4-pp2-1f1b": Case({"dp": 4, "pp": 2}, {"stage": 1, "pipeline": zjax.Pipeline(4, schedule="1f1b")}),
    # bf16 compute against the fp32 reference
    "bf16-stage2-reduce-fp32": Case({"dp": 8}, {"stage": 2, "precision": "bf16", "reduce_dtype": "float32"}, 1, BF16),
    "bf16-stage0-accum4-reduce-fp32": Case(  # the per-rank region's accumulation: fast at stage 0 in fp32
        {"dp": 8}, {"stage": 0, "precision": "bf16", "reduce_dtype": "float32"}, 4, BF16, slow=True
    ),
    "bf16-stage3-reduce-fp32": Case(
        {"dp": 8}, {"stage": 3, "precision": "bf16", "reduce_dtype": "float32"}, 1, BF16, slow=True
    ),
    "bf16-hpz": Case({"dp": (2, 4)}, {"stage": 3, "precision": "bf16", "hpz": True}, 1, BF16),
    "bf16-no-compute-copy": Case({"dp": 8}, {"stage": 3, "precision": "bf16", "compute_copy": False}, 1, BF16),
    "bf16-qgz": Case({"dp": 8}, {"stage": 3, "precision": "bf16", "quantized_comm": "grads"}, 1, QGZ),
    "bf16-qgz-accum4": Case({"dp": 8}, {"stage": 3, "precision": "bf16", "quantized_comm": "grads"}, 4, QGZ, slow=True),
}


@pytest.fixture(scope="module")
def references():
    batch = uneven_batch(ROWS)
    return batch, *reference(TINY, batch)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if c.slow else []) for n, c in CASES.items()]
)
def test_every_path_computes_the_one_device_objective(references, name, capfd):
    """... and no step makes XLA's partitioner replicate a tensor it cannot reshard ("involuntary full
    rematerialization", a whole activation per device at long context), which it reports in the compile log."""
    case = CASES[name]
    cfg = TINY if case.context_mode is None else dataclasses.replace(TINY, context_mode=case.context_mode)
    batch, loss, grads = references
    plan = zjax.Plan(zjax.make_mesh(**case.mesh), **{"precision": "fp32", **case.plan})
    with compiled_here():  # compiled, not read from a persistent cache: the partitioner's log is the evidence
        got, metrics = applied(plan, cfg, batch, case.accum)
    log = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in log, log[-3000:]
    assert relative(got, grads) <= case.tolerance, (name, relative(got, grads))
    assert abs(float(metrics["loss"]) - loss) <= max(case.tolerance, 1e-6) * loss, (name, metrics["loss"], loss)
    assert float(metrics["count"]) == batch["loss_mask"][:, 1:].sum() - _cut_targets(batch)


def _cut_targets(batch) -> float:
    """Scored targets that lie across a document boundary (not counted)."""
    if "segment_ids" not in batch:
        return 0.0
    seg, mask = batch["segment_ids"], batch["loss_mask"][:, 1:]
    return float((mask * (seg[:, 1:] != seg[:, :-1])).sum())


@pytest.mark.slow  # CI's docs step runs docs/concepts/objective.md's block: step.grads against one device
def test_step_grads_are_what_the_step_applies_and_leave_the_state_as_it_was(references):
    """``step.grads`` (the public way to see a step's gradients) gives the gradient the step applies, by the same
    path (here each rank's region with accumulation), and the state can still be used afterwards."""
    batch, loss, grads = references
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32")
    model = Decoder(TINY)
    state = plan.init(init_fn(TINY), SGD, jax.random.key(0), params=initial(TINY))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b), accum_steps=4)
    shown, metrics = step.grads(state, plan.shard_batch(batch))
    assert relative(jax.tree.map(np.asarray, shown), grads) <= FP32
    assert abs(float(metrics["loss"]) - loss) <= 1e-6 * loss
    state, _ = step(state, plan.shard_batch(batch))  # not donated by grads: the step still takes it
    np.testing.assert_allclose(
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.opt_state.inner[0].trace)]),
        np.concatenate([np.ravel(x) for x in jax.tree.leaves(shown)]),
        rtol=0,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    ("out", "error", "match"),
    [
        (lambda p: zjax.LossSum(jnp.ones(3) * p, 3.0), ValueError, "sum has shape"),
        (lambda p: ((p, 1.0), None), TypeError, "first element is a tuple"),
        (lambda p: jnp.ones(2) * p, ValueError, "scalar loss or a zjax.LossSum"),
    ],
)
def test_a_loss_that_is_neither_a_scalar_nor_a_loss_sum_is_refused(out, error, match):
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="fp32")
    state = plan.init(lambda r: {"w": jnp.ones(())}, optax.sgd(0.1), jax.random.key(0))
    step = plan.train_step(lambda p, b: out(p["w"] * jnp.sum(b)))
    with pytest.raises(error, match=match):
        step(state, plan.shard_batch(np.ones((8, 2), np.float32)))
