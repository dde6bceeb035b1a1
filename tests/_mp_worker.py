"""One process of a 2-process job (4 CPU devices each, gloo), started by tests/test_multiprocess.py.

The job comes from ZJAX_* variables. ``python -m tests._mp_worker train OUT``: train every configuration
of MP_CONFIGS for 4 steps, write
``OUT.<rank>.npz`` (losses, gathered parameters, per-device and cross-process bytes).
``python -m tests._mp_worker loop``: train forever, printing ``STEP i`` (killed from outside).
``python -m tests._mp_worker raise``: like loop, but process 1 raises after its second step.
"""

from __future__ import annotations

import sys

import zjax

zjax.distributed.initialize()  # ZJAX_COORDINATOR_ADDRESS, _NUM_PROCESSES, _PROCESS_ID, _CPU_DEVICES, timeouts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from tests._models import MP_CONFIGS, MP_ROWS, MP_STEPS, MP_TX, linen_mlp_task, regression_batch  # noqa: E402
from zjax.planner._compile import partitioned_hlo  # noqa: E402
from zjax.planner._hlo import collectives  # noqa: E402


def cross_process_volume(hlo: str, mesh) -> int:
    """Collective volume per device per step of the collectives whose groups span both processes."""
    flat = list(mesh.devices.flat)
    total = 0
    for c in collectives(hlo):
        if any(len({flat[i].process_index for i in group}) > 1 for group in c.groups):
            total += c.volume * c.trips
    return total


def train(out: str) -> None:
    rank = jax.process_index()
    init_fn, loss_fn = linen_mlp_task()
    results: dict[str, np.ndarray] = {}
    # inner axes stay inside a process: the HSDP shard group and tp; replica crosses processes
    for dp, tp in (((2, 4), 1), (4, 2)):
        spans = zjax.sharding.process_spans(zjax.make_mesh(dp=dp, tp=tp))
        print("SPANS", dp, tp, sorted(a for a, crosses in spans.items() if crosses), flush=True)
    # a wrong local batch is an error on this rank, before any communication
    try:
        zjax.shard_batch({"x": np.zeros((5, 32), np.float32)}, zjax.make_mesh(dp=8))
    except ValueError as e:
        print("BAD ROWS:", e, flush=True)
    for name, (dp, stage) in MP_CONFIGS.items():
        plan = zjax.Plan(zjax.make_mesh(dp=dp), stage=stage, precision="fp32")
        state = plan.init(init_fn, MP_TX, jax.random.key(0))
        step = plan.train_step(loss_fn)
        batches = [regression_batch(MP_ROWS, seed=i) for i in range(MP_STEPS)]
        first = plan.shard_batch(zjax.sharding.process_rows(batches[0], plan.mesh))
        compiled, hlo = partitioned_hlo(step.lower(state, first))
        losses = []
        for b in batches:
            state, metrics = step(state, plan.shard_batch(zjax.sharding.process_rows(b, plan.mesh)))
            losses.append(float(metrics["loss"]))
        params = multihost_utils.process_allgather(state.params, tiled=True)
        results[f"{name}/losses"] = np.array(losses)
        for i, leaf in enumerate(jax.tree.leaves(params)):
            results[f"{name}/param{i}"] = np.asarray(leaf)
        results[f"{name}/argument_bytes"] = np.array(compiled.memory_analysis().argument_size_in_bytes)
        results[f"{name}/cross_process_bytes"] = np.array(cross_process_volume(hlo, plan.mesh))
    np.savez(f"{out}.{rank}.npz", **results)
    print("OK", rank, jax.process_count(), jax.device_count(), flush=True)


def loop(fail: bool) -> None:
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="fp32")
    state = plan.init(init_fn, MP_TX, jax.random.key(0))
    step = plan.train_step(loss_fn)
    batch = plan.shard_batch(zjax.sharding.process_rows(regression_batch(32), plan.mesh))
    i = 0
    while True:
        state, metrics = step(state, batch)
        float(metrics["loss"])
        print("STEP", i, flush=True)
        if fail and i == 1 and jax.process_index() == 1:
            raise RuntimeError("an error in process 1")
        i += 1


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "train":
        train(sys.argv[2])
    else:
        loop(fail=mode == "raise")
