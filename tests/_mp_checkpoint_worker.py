"""One of two processes (4 CPU devices each, gloo) that save a checkpoint or restore it with new specs.

Run by tests/test_checkpoint.py: ``python -m tests._mp_checkpoint_worker PID PORT DIR save|restore|killsave``.
``killsave`` saves step 1, then starts saving a large step 2 and prints ``SAVING``; the test kills a process.
``save2`` saves steps 1 and 2 (stage 3, dp=8); ``restore_same`` restores into that layout and prints the step.
"""

import sys

import jax

import zjax

pid, port, directory, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
zjax.simulate_cpu_devices(4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=2, process_id=pid, heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10
)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from tests._models import linen_mlp_task, regression_batch  # noqa: E402

init_fn, loss_fn = linen_mlp_task()
tx = optax.adamw(1e-2)
if mode == "killsave":
    import time

    import jax.numpy as jnp

    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")

    def big(r):
        return {"w": jax.random.normal(r, (4096, 4096)), "b": jnp.zeros((4096,))}

    state = plan.init(big, optax.adamw(1e-3), jax.random.key(0))
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())

    def at(step):  # the step counter as a global array, as the train step leaves it
        return state.replace(step=jax.device_put(jnp.asarray(step, jnp.int32), replicated))

    ckpt = zjax.Checkpointer(directory)
    ckpt.save(at(1), plan)
    ckpt.wait()
    print("SAVING", pid, flush=True)
    ckpt.save(at(2), plan)
    time.sleep(120)
    sys.exit(0)
if mode == "save2":
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    state = plan.init(init_fn, tx, jax.random.key(0))
    step = plan.train_step(loss_fn)
    full = regression_batch(32)
    local = {k: v[pid * 16 : (pid + 1) * 16] for k, v in full.items()}
    with zjax.Checkpointer(directory) as ckpt:
        for _ in range(2):
            state, _ = step(state, plan.shard_batch(local))
            ckpt.save(state, plan)
            ckpt.wait()
            if int(state.step) == 1:
                host = multihost_utils.process_allgather(state.params, tiled=True)
elif mode == "restore_same":
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    with zjax.Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(plan, init_fn, tx, jax.random.key(0))
    print("RESTORED", pid, meta["step"], flush=True)
    host = multihost_utils.process_allgather(state.params, tiled=True)
elif mode == "save":
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    state = plan.init(init_fn, tx, jax.random.key(0))
    full = regression_batch(32)
    local = {k: v[pid * 16 : (pid + 1) * 16] for k, v in full.items()}  # this process's rows
    state, m = plan.train_step(loss_fn)(state, plan.shard_batch(local))
    with zjax.Checkpointer(directory) as ckpt:
        ckpt.save(state, plan)
    host = multihost_utils.process_allgather(state.params, tiled=True)
else:
    plan = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=1, precision="bf16")
    with zjax.Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(plan, init_fn, tx, jax.random.key(0))
    host = multihost_utils.process_allgather(state.params, tiled=True)
if pid == 0:
    np.savez(f"{directory}.{mode}.npz", *[np.asarray(x, np.float32) for x in jax.tree.leaves(host)])
print("OK", pid, jax.process_count(), jax.device_count(), flush=True)
jax.distributed.shutdown()
