"""Checkpoints: restore into any stage and mesh bitwise, resume bitwise, survive junk steps."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import zjax
from zjax.distributed import free_port

from ._models import linen_mlp_task, regression_batch
from ._procs import run_workers

ROOT = Path(__file__).resolve().parents[1]
MESHES = {"dp8": {"dp": 8}, "dp4_tp2": {"dp": 4, "tp": 2}}


def trained_state(stage, mesh_kw=None, tx=None, precision="bf16"):
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(**(mesh_kw or {"dp": 8})), stage=stage, precision=precision)
    tx = optax.adamw(1e-2, weight_decay=0.1) if tx is None else tx
    state = plan.init(init_fn, tx, jax.random.key(0))
    state, _ = plan.train_step(loss_fn)(state, plan.shard_batch(regression_batch()))
    return plan, state, tx


def _raw(tree):
    """Leaves as numbers (typed PRNG keys as their key data)."""
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    return jax.device_get(jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree))


def assert_bitwise(a, b):
    la, lb = jax.tree.leaves(_raw(a)), jax.tree.leaves(_raw(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


class _Saved(dict):
    """Checkpoints saved on dp=8, one per stage, made on first use."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, stage):
        directory = self.factory.mktemp(f"stage{stage}")
        plan, state, tx = trained_state(stage)
        with zjax.Checkpointer(directory) as ckpt:
            ckpt.save(state, plan, {"data_position": 1})
        self[stage] = (directory, jax.device_get(state), tx)
        return self[stage]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _Saved(tmp_path_factory)


# Every pair runs in CI but from stage 2, whose saved state is stage 1's (only the gradients, never saved,
# differ); the fast suite keeps the ends (stages 0 and 3) as sources.
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("to_stage", range(4))
@pytest.mark.parametrize("from_stage", [0, pytest.param(1, marks=pytest.mark.slow), 3])
def test_reshard_matrix(saved, from_stage, to_stage, mesh_name):
    directory, want, tx = saved[from_stage]
    plan = zjax.Plan(zjax.make_mesh(**MESHES[mesh_name]), stage=to_stage, precision="bf16")
    with zjax.Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(plan, linen_mlp_task()[0], tx, jax.random.key(0))
    assert meta["stage"] == from_stage and meta["user"] == {"data_position": 1}
    assert_bitwise(state, want)
    target = state.layout.state_shardings(state.tx)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_a_cp_run_restores_at_cp1_and_the_reverse(saved, tmp_path):
    """ZeRO-3 shards state over dp x cp: a checkpoint saved at dp=8 restores at dp=2 x cp=4 and one saved there
    restores at dp=8, bitwise, each leaf in its new layout."""
    directory, want, tx = saved[3]
    cp_plan = zjax.Plan(zjax.make_mesh(dp=2, cp=4), stage=3, precision="bf16")
    with zjax.Checkpointer(directory) as ckpt:
        state, _ = ckpt.restore(cp_plan, linen_mlp_task()[0], tx, jax.random.key(0))
    assert_bitwise(state, want)
    assert any("cp" in str(leaf.sharding.spec) for leaf in jax.tree.leaves(state.params))
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, cp_plan, {"data_position": 1})
    with zjax.Checkpointer(tmp_path) as ckpt:
        back, _ = ckpt.restore(zjax.Plan(zjax.make_mesh(dp=8), stage=3), linen_mlp_task()[0], tx, jax.random.key(0))
    assert_bitwise(back, want)


def test_restore_in_a_four_device_process(saved, tmp_path):
    directory, want, _ = saved[3]
    expected = tmp_path / "want.npz"
    np.savez(expected, *[np.asarray(x, np.float32) for x in jax.tree.leaves(_raw(want))])
    script = f"""
import jax, zjax
zjax.simulate_cpu_devices(4)
import numpy as np, optax
from tests._models import linen_mlp_task
plan = zjax.Plan(zjax.make_mesh(dp=2, tp=2), stage=1, precision="bf16")
with zjax.Checkpointer({str(directory)!r}) as ckpt:
    state, meta = ckpt.restore(plan, linen_mlp_task()[0], optax.adamw(1e-2, weight_decay=0.1), jax.random.key(0))
want = np.load({str(expected)!r})
state = state.replace(rng=jax.random.key_data(state.rng))
got = [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(state))]
assert len(got) == len(want.files)
assert all(np.array_equal(g, want[f"arr_{{i}}"]) for i, g in enumerate(got))
print("OK", jax.device_count())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "OK 4" in proc.stdout, proc.stdout + proc.stderr


def test_donated_step_right_after_save_does_not_corrupt(tmp_path):
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
    tx = optax.adamw(1e-2)
    state = plan.init(init_fn, tx, jax.random.key(0))
    step = plan.train_step(loss_fn)
    want = jax.device_get(state)
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)  # returns while the write may still run
        for _ in range(3):
            state, _ = step(state, plan.shard_batch(regression_batch()))  # donates the saved buffers
        jax.block_until_ready(state)
    with zjax.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(plan, init_fn, tx, jax.random.key(0))
    assert_bitwise(restored, want)


def test_fallback_past_an_empty_step_directory(tmp_path):
    plan, state, tx = trained_state(2)
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan, {"data_position": 1})
    want = jax.device_get(state)
    os.makedirs(tmp_path / "7")  # an empty integer-named directory counts as a step for orbax
    with zjax.Checkpointer(tmp_path) as ckpt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored, meta = ckpt.restore(plan, linen_mlp_task()[0], tx, jax.random.key(0))
    assert meta["step"] == 1
    assert any("skipped damaged checkpoint step 7" in str(w.message) for w in caught)
    assert_bitwise(restored, want)


def test_precision_change_is_a_clear_error(saved):
    directory, _, tx = saved[1]
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision="fp32")
    with zjax.Checkpointer(directory) as ckpt, pytest.raises(ValueError, match="saved with precision 'bf16'"):
        ckpt.restore(plan, linen_mlp_task()[0], tx, jax.random.key(0))


@pytest.mark.parametrize(
    "tx",
    [
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
        optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        optax.multi_transform(
            {"a": optax.adam(1e-2), "s": optax.sgd(1e-2)},
            lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "s", p),
        ),
    ],
    ids=["inject_hyperparams", "masked", "multi_transform"],
)
def test_optax_states_round_trip(tmp_path, tx):
    plan, state, tx = trained_state(1, tx=tx)
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
    with zjax.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(plan, linen_mlp_task()[0], tx, jax.random.key(0))
    assert jax.tree.structure(restored) == jax.tree.structure(state)  # the same plan: the same layout
    assert_bitwise(restored, state)


def run_example(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_lm.py"), "--preset", "tiny", "--steps", "4", "--seq-len", "32",
        "--batch-size", "16", "--no-progress", "--metrics-json", str(out), *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_resume_in_a_new_process_is_bitwise(tmp_path):
    straight, _ = run_example(tmp_path, "straight")
    ckpt = str(tmp_path / "ckpt")
    run_example(tmp_path, "first", "--checkpoint-dir", ckpt, "--save-every", "2", "--stop-at", "2")
    resumed, out = run_example(tmp_path, "resumed", "--checkpoint-dir", ckpt, "--save-every", "2", "--resume")
    assert "resumed from step 2" in out
    assert resumed["losses"] == straight["losses"][2:]
    info = subprocess.run(
        [sys.executable, "-m", "zjax.cli", "ckpt", "info", ckpt], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert info.returncode == 0, info.stderr
    assert "steps [2, 4]" in info.stdout and "params/layers/wq" in info.stdout


# A damaged step's failed reads leave orbax/tensorstore futures whose errors nobody retrieves; Python reports
# them as unraisable when they are collected. Expected here: collect them inside this test and ignore them.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_fallback_past_a_truncated_step(tmp_path):
    plan, state, tx = trained_state(3)
    init_fn, loss_fn = linen_mlp_task()
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
        want = jax.device_get(state)
        state, _ = plan.train_step(loss_fn)(state, plan.shard_batch(regression_batch(seed=1)))
        ckpt.save(state, plan)
    files = [p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert files
    for f in files:
        if f.name not in ("_METADATA", "_sharding", "manifest.ocdbt", "_CHECKPOINT_METADATA"):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a write cut short
    with zjax.Checkpointer(tmp_path) as ckpt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored, meta = ckpt.restore(plan, init_fn, tx, jax.random.key(0))
    assert meta["step"] == 1
    assert any(
        "skipped damaged checkpoint step 2" in str(w.message) and "OUT_OF_RANGE" in str(w.message) for w in caught
    )
    assert_bitwise(restored, want)
    import gc

    gc.collect()


def test_nnx_state_restores_into_another_stage_and_mesh(tmp_path):
    from ._models import nnx_mlp_task, train

    init_fn, loss_fn = nnx_mlp_task()
    tx = optax.adamw(1e-2)
    _, state, plan = train((init_fn, loss_fn), [regression_batch()], stage=3, tx=tx, precision="bf16")
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
    plan2 = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=1, precision="bf16")
    with zjax.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(plan2, init_fn, tx, jax.random.key(0))
    # the same trees; the layouts (static) differ: the restored one is plan2's
    assert jax.tree.structure(restored.replace(layout=None)) == jax.tree.structure(state.replace(layout=None))
    assert restored.layout.stage.level == 1 and restored.layout != state.layout
    assert_bitwise(restored, state)
    assert "tp" in str(restored.params["up"]["kernel"].sharding.spec)


KILL_SCRIPT = """
import sys, time
import jax, zjax
zjax.simulate_cpu_devices(8)
import jax.numpy as jnp, optax
plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")
init = lambda r: {"w": jax.random.normal(r, (4096, 4096)), "b": jnp.zeros((4096,))}
state = plan.init(init, optax.adamw(1e-3), jax.random.key(0))
ckpt = zjax.Checkpointer(sys.argv[1])
if not ckpt.steps():
    ckpt.save(state.replace(step=jnp.asarray(1, jnp.int32)), plan)
    ckpt.wait()
print("SAVING", flush=True)
ckpt.save(state.replace(step=jnp.asarray(2, jnp.int32)), plan)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.1, 0.3, 0.8])
def test_sigkill_during_save_leaves_a_restorable_checkpoint(tmp_path, delay):
    import time

    directory = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(directory)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout.readline().strip() == "SAVING"
        time.sleep(delay)
    finally:
        proc.kill()  # SIGKILL: no cleanup, no atexit
        proc.wait(timeout=60)
        proc.stdout.close()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")

    def init(r):
        return {"w": jax.random.normal(r, (4096, 4096)), "b": jax.numpy.zeros((4096,))}

    tx = optax.adamw(1e-3)
    want = jax.device_get(plan.init(init, tx, jax.random.key(0)).params)
    with zjax.Checkpointer(directory) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored, meta = ckpt.restore(plan, init, tx, jax.random.key(0))
        assert meta["step"] in (1, 2)  # step 2 only if its write completed before the kill
        assert_bitwise(restored.params, want)
        if meta["step"] == 1:  # saving the interrupted step again works
            ckpt.save(restored.replace(step=jax.numpy.asarray(2, jax.numpy.int32)), plan)
    with zjax.Checkpointer(directory) as ckpt:
        _, meta = ckpt.restore(plan, init, tx, jax.random.key(0))
        assert meta["step"] == 2


PREEMPT_CMD = [
    sys.executable, "-u", str(ROOT / "examples" / "train_lm.py"), "--preset", "tiny", "--seq-len", "32",
    "--batch-size", "16", "--no-progress", "--save-every", "1000", "--steps", "400",
]  # fmt: skip


def _preempt(ckpt: Path, marker: str, *flags: str, env: dict[str, str] | None = None) -> list[str]:
    """Run the example with ``flags``, send SIGTERM once a line starts with ``marker``; its output lines.

    Asserts that it exits 0.
    """
    import signal

    proc = subprocess.Popen(
        [*PREEMPT_CMD, "--checkpoint-dir", str(ckpt), "--preemptible", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(marker):  # training is under way
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        assert proc.wait(timeout=120) == 0, "".join(lines)
    finally:
        proc.kill()
        proc.stdout.close()
    return lines


def _assert_resumes(ckpt: Path, step: int) -> None:
    """A one-process run of the example continues from ``step``."""
    resumed = subprocess.run(
        [*PREEMPT_CMD[:-1], str(step + 2), "--checkpoint-dir", str(ckpt), "--resume"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert resumed.returncode == 0 and f"resumed from step {step}" in resumed.stdout, resumed.stdout + resumed.stderr


def _two_processes(directory: Path, mode: str) -> list[str]:
    port = str(free_port())
    cmd = [sys.executable, "-m", "tests._mp_checkpoint_worker"]
    runs = run_workers([[*cmd, str(pid), port, str(directory), mode] for pid in (0, 1)], timeout=240)
    outs = [out for _, out in runs]
    for pid, (rc, out) in enumerate(runs):
        assert rc == 0 and f"OK {pid} 2 8" in out, out[-3000:]
    return outs


@pytest.mark.slow
def test_two_processes_save_and_restore_anywhere(tmp_path):
    """2 processes x 4 devices (gloo): save at stage 3 on dp=8 with per-process batch rows; restore at stage 1
    on dp=4 x tp=2 in 2 processes, and at stage 0 in 1 process x 8 devices: bitwise."""
    directory = tmp_path / "ckpt"
    _two_processes(directory, "save")
    _two_processes(directory, "restore")
    saved = np.load(f"{directory}.save.npz")
    restored = np.load(f"{directory}.restore.npz")
    assert all(np.array_equal(saved[f], restored[f]) for f in saved.files)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision="bf16")
    with zjax.Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(plan, linen_mlp_task()[0], optax.adamw(1e-2), jax.random.key(0))
    assert meta["processes"] == 2
    got = [np.asarray(x, np.float32) for x in jax.tree.leaves(jax.device_get(state.params))]
    assert all(np.array_equal(g, saved[f"arr_{i}"]) for i, g in enumerate(got))


def test_shape_mismatch_raises_never_pads(saved):
    from ._models import LinenMLP

    directory, _, tx = saved[1]
    wider = LinenMLP(hidden=256)

    def init_fn(rng):
        return wider.init(rng, jax.numpy.zeros((1, 32)))["params"]

    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision="bf16")
    with (
        zjax.Checkpointer(directory) as ckpt,
        pytest.raises(ValueError, match=r"params/Dense_0/bias: saved \(128,\), model \(256,\)"),
    ):
        ckpt.restore(plan, init_fn, tx, jax.random.key(0))


def test_resume_across_a_stage_and_mesh_change(tmp_path):
    """3 steps at stage 3 on dp=8, then 3 more at stage 1 on dp=4 x tp=2 after a restore, vs 6 straight (fp32)."""
    init_fn, loss_fn = linen_mlp_task()
    tx = optax.sgd(0.3, momentum=0.9)
    data = [regression_batch(seed=i) for i in range(6)]

    def run(plan, state, batches):
        step, losses = plan.train_step(loss_fn), []
        for b in batches:
            state, m = step(state, plan.shard_batch(b))
            losses.append(float(m["loss"]))
        return state, losses

    plan_a = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="fp32")
    _, straight = run(plan_a, plan_a.init(init_fn, tx, jax.random.key(0)), data)
    state, first = run(plan_a, plan_a.init(init_fn, tx, jax.random.key(0)), data[:3])
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan_a)
    plan_b = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=1, precision="fp32")
    with zjax.Checkpointer(tmp_path) as ckpt:
        state, _ = ckpt.restore(plan_b, init_fn, tx, jax.random.key(0))
    _, second = run(plan_b, state, data[3:])
    np.testing.assert_array_equal(first, straight[:3])
    np.testing.assert_allclose(second, straight[3:], rtol=1e-5)  # reduction order differs with the mesh


def test_rng_is_saved_and_a_resumed_run_draws_the_same_keys(tmp_path):
    """``state.rng`` (a typed key) feeds a ``loss_fn(params, batch, rng)`` (dropout); it round-trips, so a
    resumed run draws the same masks. With a zero learning rate only the keys change the loss."""
    init_fn, loss_fn = linen_mlp_task()
    tx = optax.sgd(0.0)

    def dropout_loss(params, batch, rng):
        keep = jax.random.bernoulli(rng, 0.8, batch["x"].shape)
        return loss_fn(params, {**batch, "x": jnp.where(keep, batch["x"] / 0.8, 0.0)})

    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=2, precision="fp32")
    step = plan.train_step(dropout_loss, accum_steps=2)
    batch = plan.shard_batch(regression_batch(32))
    state = plan.init(init_fn, tx, jax.random.key(0))
    losses = []
    with zjax.Checkpointer(tmp_path) as ckpt:
        for i in range(4):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
            if i == 1:
                ckpt.save(state, plan)
                ckpt.wait()
    assert len(set(losses)) == 4  # a fresh key every step
    with zjax.Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(plan, init_fn, tx, jax.random.key(0))
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    again = []
    for _ in range(2):
        restored, m = step(restored, batch)
        again.append(float(m["loss"]))
    assert again == losses[2:]
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))


def test_a_loss_without_rng_leaves_the_key_alone():
    """Only a loss that takes ``rng`` makes the step split ``state.rng``: otherwise the program draws no
    key (XLA:CPU runs threefry as a loop) and the key stays as it was."""
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=1, precision="fp32")
    state = plan.init(init_fn, optax.sgd(0.1), jax.random.key(0))
    batch = plan.shard_batch(regression_batch(32))
    plain = plan.train_step(loss_fn)
    assert "threefry" not in plain.lower(state, batch).as_text()
    with_rng = plan.train_step(lambda params, b, rng: loss_fn(params, b))
    assert "threefry" in with_rng.lower(state, batch).as_text()
    before = np.asarray(jax.random.key_data(state.rng))
    state, _ = plain(state, batch)
    np.testing.assert_array_equal(jax.random.key_data(state.rng), before)
    state, _ = with_rng(state, batch)
    assert not np.array_equal(jax.random.key_data(state.rng), before)


@pytest.mark.parametrize("precision, reads", [("fp32", False), ("bf16", False), ("fp16", True)])
def test_only_loss_scaling_reads_the_loss_scale(precision, reads):
    """Without loss scaling the step multiplies by the constant 1, which XLA folds away; a runtime 1.0 from
    the state would be one more operand in every gradient fusion (measured: +9-15% of a small fp32 step
    on XLA:CPU). Only fp16's dynamic scaling reads ``state.loss_scale.scale``."""
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=0, precision=precision)
    state = plan.init(init_fn, optax.adam(1e-3), jax.random.key(0))
    batch = plan.shard_batch(regression_batch(32))
    step = plan.train_step(loss_fn)
    closed = jax.make_jaxpr(step._jit(state, batch))(state, batch)
    (call,) = closed.jaxpr.eqns
    inner = call.params["jaxpr"].jaxpr
    leaves = jax.tree_util.tree_leaves((state, batch))
    where = next(i for i, leaf in enumerate(leaves) if leaf is state.loss_scale.scale)
    scale_var = inner.invars[where]
    used = any(scale_var in eqn.invars for eqn in inner.eqns)
    assert used == reads
    if not reads:  # the constant 1 reaches the metrics too
        _, metrics = step(state, batch)
        assert float(metrics["loss_scale"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_two_processes_one_killed_mid_save_leaves_the_previous_step(tmp_path, delay):
    """2 processes save step 1, then start a large step 2; process 1 is SIGKILLed during it. Process 0 ends
    (the runtime aborts it), step 1 stays the latest restorable step, and saving step 2 again works."""
    import time

    directory = tmp_path / "ckpt"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._mp_checkpoint_worker", str(pid), port, str(directory), "killsave"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for pid in (0, 1)
    ]
    try:
        for pid, p in enumerate(procs):
            for line in p.stdout:
                if line.startswith(f"SAVING {pid}"):
                    break
        time.sleep(delay)
        procs[1].kill()
        assert procs[0].wait(timeout=60) != 0  # the survivor is ended by the runtime, not left hanging
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")

    def init(r):
        return {"w": jax.random.normal(r, (4096, 4096)), "b": jax.numpy.zeros((4096,))}

    tx = optax.adamw(1e-3)
    want = jax.device_get(plan.init(init, tx, jax.random.key(0)).params)
    with zjax.Checkpointer(directory) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        restored, meta = ckpt.restore(plan, init, tx, jax.random.key(0))
        # killed at once, step 2 cannot be complete; later it may be (then it restores whole)
        assert meta["step"] == 1 if delay == 0 else meta["step"] in (1, 2)
        assert meta["processes"] == 2
        assert_bitwise(restored.params, want)
        if meta["step"] == 1:  # saving the interrupted step again works
            ckpt.save(restored.replace(step=jax.numpy.asarray(2, jax.numpy.int32)), plan)
    with zjax.Checkpointer(directory) as ckpt:
        assert ckpt.restore(plan, init, tx, jax.random.key(0))[1]["step"] == 2


@pytest.mark.slow
def test_two_processes_sigterm_save_the_same_step_and_exit_cleanly(tmp_path):
    """The example on 2 processes (zjax launch): SIGTERM to the launcher reaches both; they agree on a step,
    save it once and exit 0; a 1-process run resumes from it."""
    ckpt = tmp_path / "ckpt"
    timeouts = {"ZJAX_HEARTBEAT_TIMEOUT_S": "10", "ZJAX_SHUTDOWN_TIMEOUT_S": "30"}
    lines = _preempt(ckpt, "[0] step ", "--processes", "2", env=timeouts)
    saved = {line[:3]: int(line.split()[4].rstrip(",")) for line in lines if "preempted: saved step" in line}
    assert set(saved) == {"[0]", "[1]"} and len(set(saved.values())) == 1, "".join(lines)
    step = saved["[0]"]
    with zjax.Checkpointer(ckpt) as c:
        assert c.steps() == [step]
        assert c.metadata(step)["processes"] == 2
    _assert_resumes(ckpt, step)


@pytest.mark.slow
def test_save_returns_before_the_write_ends(tmp_path):
    """A 256 MB state: ``save`` hands the write to a background thread and returns while it runs."""
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="bf16")

    def init(r):
        return {"w": jax.random.normal(r, (4096, 4096)), "b": jnp.zeros((4096,))}

    state = plan.init(init, optax.adamw(1e-3), jax.random.key(0))
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
        assert ckpt.saving()
        ckpt.wait()
        assert not ckpt.saving() and ckpt.steps() == [0]


def test_a_transient_read_error_is_raised_and_deletes_nothing(tmp_path, monkeypatch):
    """An OSError while reading the newest step is not damage: restore_or_init raises (never starts over
    at step 0), every step stays on disk, and the next call restores the newest step."""
    plan, state, tx = trained_state(1)
    init_fn = linen_mlp_task()[0]
    with zjax.Checkpointer(tmp_path, max_to_keep=3) as ckpt:
        ckpt.save(state, plan)
        ckpt.save(state.replace(step=state.step + 4), plan)
    real = ocp.CheckpointManager.restore
    calls = []

    def flaky(self, step, *args, **kwargs):  # the first read of the arrays fails once, as a flaky disk would
        if not calls and "state" in list(kwargs["args"].keys()):
            calls.append(step)
            raise OSError(5, "Input/output error (injected)")
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky)
    with zjax.Checkpointer(tmp_path, max_to_keep=3) as ckpt:
        with pytest.raises(
            zjax.checkpoint.RestoreError, match=r"step 5 .* failed with OSError.*nothing was skipped"
        ) as err:
            ckpt.restore_or_init(plan, init_fn, tx, jax.random.key(0))
        assert isinstance(err.value.__cause__, OSError) and err.value.step == 5
        assert ckpt.steps() == [1, 5]
        restored, meta = ckpt.restore_or_init(plan, init_fn, tx, jax.random.key(0))
    assert calls == [5] and meta["step"] == 5 and int(restored.step) == 5


def test_every_step_damaged_raises_and_deletes_nothing(tmp_path):
    plan, state, tx = trained_state(1)
    with zjax.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, plan)
    os.remove(tmp_path / "1" / "_CHECKPOINT_METADATA")  # the commit never finished
    os.makedirs(tmp_path / "3")
    with zjax.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(
            FileNotFoundError, match=r"every step is damaged .*step 3: .*missing.*step 1: .*Nothing was deleted"
        ):
            ckpt.restore_or_init(plan, linen_mlp_task()[0], tx, jax.random.key(0))
        assert ckpt.steps() == [1, 3]


def test_a_fresh_directory_starts_from_init(tmp_path):
    plan, _, tx = trained_state(0)
    with zjax.Checkpointer(tmp_path / "new") as ckpt:
        state, meta = ckpt.restore_or_init(plan, linen_mlp_task()[0], tx, jax.random.key(0))
    assert meta is None and int(state.step) == 0 and state.layout is not None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_two_processes_a_step_damaged_for_one_process_both_restore_the_older_step(tmp_path):
    """Step 2's array files written by process 1 are cut short: only process 1's reads fail. Both processes
    agree to skip it and restore step 1 (the same step, bitwise)."""
    directory = tmp_path / "ckpt"
    _two_processes(directory, "save2")
    files = [p for p in (directory / "2" / "state" / "ocdbt.process_1").rglob("*") if p.is_file() and "/d/" in str(p)]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    outs = _two_processes(directory, "restore_same")
    assert all(f"RESTORED {pid} 1" in out for pid, out in enumerate(outs)), outs
    saved = np.load(f"{directory}.save2.npz")
    restored = np.load(f"{directory}.restore_same.npz")
    assert all(np.array_equal(saved[f], restored[f]) for f in saved.files)
