"""Multi-process jobs without processes: reading clusters from faked environments, meshes, HSDP on 8 devices."""

from __future__ import annotations

import io
import sys

import jax
import numpy as np
import optax
import pytest

import zjax
from zjax.distributed import ClusterEnv, ClusterError, Timeouts, detect
from zjax.planner import count_collectives
from zjax.planner._compile import partitioned_hlo
from zjax.planner._hlo import collectives, replica_groups, spanned_axes

from ._models import linen_mlp_task, regression_batch

SLURM_BASE = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_NODELIST": "gpu[003-004,010],cpu1",
    "SLURM_NODEID": "1",
}


def slurm(tasks_per_node: str, ntasks: int, procid: int, localid: int, **extra: str) -> dict[str, str]:
    env = {
        **SLURM_BASE,
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
    }
    return {**env, **extra}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, ClusterEnv("single", None, 1, 0), id="nothing"),
        pytest.param(
            # one task per node on 3 nodes with 8 GPUs each: every GPU, not just GPU 0 (JAX's default)
            slurm("1(x3)", 3, 1, 0, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
            ClusterEnv("slurm", "gpu003:62016", 3, 1, None),
            id="slurm-one-task-per-node",
        ),
        pytest.param(
            slurm("8(x3)", 24, 13, 5, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
            ClusterEnv("slurm", "gpu003:62016", 24, 13, (5,)),
            id="slurm-one-task-per-gpu",
        ),
        pytest.param(
            slurm("8(x3)", 24, 13, 5, CUDA_VISIBLE_DEVICES="5"),
            ClusterEnv("slurm", "gpu003:62016", 24, 13, None),
            id="slurm-gpus-bound-per-task",
        ),
        pytest.param(
            slurm("2(x3)", 6, 3, 1, SLURM_GPUS_ON_NODE="8"),
            ClusterEnv("slurm", "gpu003:62016", 6, 3, (4, 5, 6, 7)),
            id="slurm-two-tasks-share-eight-gpus",
        ),
        pytest.param(
            slurm("1(x3)", 3, 2, 0, ZJAX_COORDINATOR_PORT="7000"),
            ClusterEnv("slurm", "gpu003:7000", 3, 2, None),
            id="slurm-port-override",
        ),
        pytest.param(
            {
                "OMPI_COMM_WORLD_SIZE": "16",
                "OMPI_COMM_WORLD_RANK": "9",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
                "OMPI_MCA_orte_hnp_uri": "3045654528.0;tcp://10.1.2.3,192.168.0.7:45211",
                "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
            },
            # the port JAX derives from the Open MPI job id, so zjax and JAX agree
            ClusterEnv("ompi", "10.1.2.3:63632", 16, 9, (1,)),
            id="openmpi4",
        ),
        pytest.param(
            {  # OMPI beats SLURM when both are present (mpirun inside an allocation), as in JAX
                **slurm("1(x3)", 3, 2, 0),
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_MCA_orte_hnp_uri": "4096.0;tcp://10.0.0.9:1",
            },
            ClusterEnv("ompi", "10.0.0.9:61441", 2, 1, None),
            id="openmpi-over-slurm",
        ),
        pytest.param(
            {"ZJAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "ZJAX_NUM_PROCESSES": "4", "ZJAX_PROCESS_ID": "3"},
            ClusterEnv("explicit", "10.0.0.1:1234", 4, 3, None),
            id="explicit-variables",
        ),
        pytest.param(
            {
                "JAX_COORDINATOR_ADDRESS": "head:99",
                "ZJAX_NUM_PROCESSES": "2",
                "ZJAX_PROCESS_ID": "0",
                "JAX_LOCAL_DEVICE_IDS": "0,1",
            },
            ClusterEnv("explicit", "head:99", 2, 0, (0, 1)),
            id="jax-variables",
        ),
        pytest.param(
            {  # Open MPI 5 has no ORTE URI: the coordinator comes from the user
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_RANK": "2",
                "ZJAX_COORDINATOR_ADDRESS": "n0:5000",
            },
            ClusterEnv("ompi", "n0:5000", 4, 2, None),
            id="openmpi5-with-coordinator",
        ),
        pytest.param(
            {
                "KUBERNETES_SERVICE_HOST": "10.96.0.1",
                "JOB_COMPLETION_INDEX": "2",
                "ZJAX_NUM_PROCESSES": "4",
                "ZJAX_COORDINATOR_ADDRESS": "train-0.train:1234",
            },
            ClusterEnv("kubernetes", "train-0.train:1234", 4, 2, None),
            id="kubernetes-indexed-job",
        ),
        pytest.param(
            {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"},
            ClusterEnv("torchrun", "10.0.0.5:29501", 2, 1, None),
            id="torchrun-variables",
        ),
        pytest.param(
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu1"},
            ClusterEnv("single", None, 1, 0),
            id="sbatch-one-node-one-process",
        ),
    ],
)
def test_detect(env, expected):
    assert detect(env) == expected


@pytest.mark.parametrize(
    ("env", "match"),
    [
        pytest.param(
            {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[1-4]"},
            r"spans 4 nodes, but this process is not an srun task \(missing SLURM_STEP_NODELIST, SLURM_NTASKS, "
            r"SLURM_PROCID, SLURM_LOCALID\).*srun python train.py",
            id="sbatch-without-srun",
        ),
        pytest.param(
            {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"},
            r"4 processes \(the ompi environment\) but no coordinator address\. Open MPI 5 \(PRRTE\).*"
            r"ZJAX_COORDINATOR_ADDRESS=host:port",
            id="openmpi5",
        ),
        pytest.param(
            {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "0"},
            r"without ZJAX_NUM_PROCESSES: set ZJAX_NUM_PROCESSES.*ZJAX_COORDINATOR_ADDRESS",
            id="kubernetes-without-size",
        ),
        pytest.param(
            {"ZJAX_NUM_PROCESSES": "2"},
            r"ZJAX_NUM_PROCESSES=2 is set but not ZJAX_PROCESS_ID",
            id="count-without-id",
        ),
        pytest.param(
            {"ZJAX_COORDINATOR_ADDRESS": "h:1", "ZJAX_NUM_PROCESSES": "2", "ZJAX_PROCESS_ID": "2"},
            r"process id 2 is not in \[0, 2\)",
            id="id-out-of-range",
        ),
        pytest.param(
            {"ZJAX_COORDINATOR_ADDRESS": "h", "ZJAX_NUM_PROCESSES": "2", "ZJAX_PROCESS_ID": "0"},
            r"coordinator address 'h' must be host:port",
            id="address-without-port",
        ),
        pytest.param(
            {"ZJAX_NUM_PROCESSES": "two", "ZJAX_PROCESS_ID": "0"},
            r"ZJAX_NUM_PROCESSES='two' must be a non-negative integer",
            id="not-a-number",
        ),
        pytest.param(
            slurm("3(x3)", 9, 4, 1, CUDA_VISIBLE_DEVICES="0,1,2,3"),
            r"3 processes share this node but it has 4 visible GPUs",
            id="uneven-gpu-split",
        ),
    ],
)
def test_detect_errors(env, match):
    with pytest.raises(ClusterError, match=match):
        detect(env)


def test_explicit_arguments_win_over_the_cluster():
    env = slurm("8(x3)", 24, 13, 5, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    got = detect(env, coordinator_address="10.9.9.9:1", local_device_ids=(0, 1, 2, 3, 4, 5, 6, 7))
    assert got == ClusterEnv("slurm", "10.9.9.9:1", 24, 13, (0, 1, 2, 3, 4, 5, 6, 7))


def test_timeouts_from_env_and_bad_values():
    assert Timeouts.from_env({}) == Timeouts(300, 60, 120)
    assert Timeouts.from_env({"ZJAX_HEARTBEAT_TIMEOUT_S": "5", "ZJAX_SHUTDOWN_TIMEOUT_S": "6"}) == Timeouts(300, 5, 6)
    with pytest.raises(ClusterError, match="ZJAX_HEARTBEAT_TIMEOUT_S='0' must be a positive integer"):
        Timeouts.from_env({"ZJAX_HEARTBEAT_TIMEOUT_S": "0"})
    with pytest.raises(ValueError, match="heartbeat=-1 must be a positive int"):
        Timeouts(heartbeat=-1)


def test_single_process_initialize_is_a_no_op():
    # the test process has its backend running already: a single process must not touch jax.distributed
    saved = dict(zjax.distributed._initialize._STATE)
    zjax.distributed._initialize._STATE.clear()
    try:
        assert zjax.distributed.initialize(env={}).source == "single"
        assert not jax.distributed.is_initialized()
    finally:
        zjax.distributed._initialize._STATE.clear()
        zjax.distributed._initialize._STATE.update(saved)


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="processes=0 must be a positive int"):
        zjax.distributed.launch([sys.executable, "-c", "pass"], 0)
    with pytest.raises(ValueError, match="command is empty"):
        zjax.distributed.launch([], 2)


def test_launch_reports_a_failed_peer():
    """Process 1 exits with 3 while process 0 keeps running: the launcher ends it and says what to do."""
    code = (
        "import os, sys, time\n"
        "if os.environ['ZJAX_PROCESS_ID'] == '1': sys.exit(3)\n"
        "print('waiting', os.environ['ZJAX_NUM_PROCESSES'], flush=True); time.sleep(60)\n"
    )
    out = io.StringIO()
    rc = zjax.distributed.launch([sys.executable, "-c", code], 2, grace_s=0.5, out=out)
    text = out.getvalue()
    assert rc == 3
    assert "[0] waiting 2" in text
    assert "process 1 of 2 failed (exit status 3); peer failed" in text
    assert "0: killed by SIGKILL" in text and "Resume from the last checkpoint" in text


GLOO = "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : {}"


def test_launch_drops_gloo_connection_lines_even_when_two_share_a_line():
    """Gloo's threads print these unsynchronized (seen in the HSDP example: two messages in one line, the first's
    count on the next; in zjax train's two processes: two written into each other word by word); a process's own
    lines pass, and a whole message with a missing peer is kept."""
    code = (
        "import sys\n"
        f"print({GLOO.format(1, 3, 3)!r})\n"
        f"print({GLOO.format(3, 3, '') + GLOO.format(2, 3, 3)!r})\n"
        "print('3')\n"
        # two written into each other word by word (seen in zjax train loop.processes=2), the rest on its own line
        "print('[Gloo] Rank [Gloo] Rank 56 is connected to  is connected to 77 peer ranks. Expected number of "
        "connected peer ranks is : 7')\n"
        "print(' peer ranks. Expected number of connected peer ranks is : 7')\n"
        f"print({GLOO.format(4, 3, 3) + '[Gloo] Rank'!r})\n"
        "print('step 2 loss 5.1786')\n"
        f"print({GLOO.format(0, 2, 3)!r})\n"
        "print('7')\n"
    )
    out = io.StringIO()
    assert zjax.distributed.launch([sys.executable, "-c", code], 1, out=out) == 0
    assert out.getvalue().splitlines() == [
        "[0] step 2 loss 5.1786",
        f"[0] {GLOO.format(0, 2, 3)}",  # one peer short: kept
        "[0] 7",  # the program's own output, not a cut count
    ]


# -- meshes ------------------------------------------------------------------------------------------


def test_hsdp_mesh_and_data_axes():
    mesh = zjax.make_mesh(dp=(2, 4))
    assert dict(mesh.shape) == {"pp": 1, "replica": 2, "dp": 4, "ep": 1, "cp": 1, "tp": 1}
    assert zjax.sharding.data_axes(mesh) == ("replica", "dp") and zjax.sharding.data_size(mesh) == 8
    assert zjax.sharding.batch_spec(2, mesh) == jax.sharding.PartitionSpec(("replica", "dp"), None)
    assert zjax.sharding.data_axes(zjax.make_mesh(dp=8)) == ("dp",)
    assert zjax.sharding.process_spans(mesh) == {
        "pp": False,
        "replica": False,
        "dp": False,
        "ep": False,
        "cp": False,
        "tp": False,
    }
    with pytest.raises(ValueError, match=r"dp=\(2, 2, 2\) must be an int or a \(replica, shard\) pair"):
        zjax.make_mesh(dp=(2, 2, 2))
    with pytest.raises(ValueError, match="replica=3 x dp=4 x tp=1 x pp=1 = 12 devices, but 8 are available"):
        zjax.make_mesh(dp=(3, 4))


def test_dcn_split_keeps_tp_inside_a_node():
    sizes = {"pp": 2, "replica": 4, "dp": 8, "tp": 8}
    assert zjax.sharding.dcn_split(sizes, 4) == {"pp": 1, "replica": 4, "dp": 1, "tp": 1}
    assert zjax.sharding.dcn_split(sizes, 16) == {"pp": 2, "replica": 4, "dp": 2, "tp": 1}
    with pytest.raises(
        ValueError, match="cannot be divided among replica=1, pp=1 and dp=2 without putting ep, cp or tp"
    ):
        zjax.sharding.dcn_split({"pp": 1, "replica": 1, "dp": 2, "tp": 8}, 4)


def test_process_rows_in_one_process_is_the_whole_batch():
    mesh = zjax.make_mesh(dp=(2, 4))
    batch = regression_batch(16)
    rows = zjax.sharding.process_rows(batch, mesh)
    assert all(np.array_equal(rows[k], batch[k]) for k in batch)
    assert zjax.sharding.local_batch_parts(mesh) == 8
    with pytest.raises(ValueError, match=r"leading dimension 12 is not divisible by mesh axis 'replica' x 'dp' of"):
        zjax.sharding.process_rows(regression_batch(12), mesh)


# -- HLO replica groups ------------------------------------------------------------------------------

SHAPE = {"pp": 1, "replica": 2, "dp": 4, "tp": 1}


@pytest.mark.parametrize(
    ("attrs", "groups", "axes"),
    [
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, use", [[0, 4], [1, 5], [2, 6], [3, 7]], ("replica",)),
        ("replica_groups=[2,4]<=[8], dimensions", [[0, 1, 2, 3], [4, 5, 6, 7]], ("dp",)),
        ("replica_groups=[4,2]<=[2,4]T(1,0), use", [[0, 4], [1, 5], [2, 6], [3, 7]], ("replica",)),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use", [[0, 1, 2, 3], [4, 5, 6, 7]], ("dp",)),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dim",
            [[0, 1, 2, 3], [4, 5, 6, 7]],
            ("dp",),
        ),
        ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use", [list(range(8))], ("replica", "dp")),
        ("replica_groups={}, use", [list(range(8))], ("replica", "dp")),
    ],
)
def test_replica_group_formats(attrs, groups, axes):
    got = replica_groups(attrs, 8)
    assert sorted(map(sorted, got)) == sorted(map(sorted, groups))
    assert spanned_axes(got, SHAPE) == axes


# -- HSDP on 8 devices (1 process) ---------------------------------------------------------------------


def _compile(dp, stage):
    init_fn, loss_fn = linen_mlp_task()
    plan = zjax.Plan(zjax.make_mesh(dp=dp), stage=stage, precision="bf16")
    state = plan.abstract_state(init_fn, optax.adamw(1e-2), jax.random.key(0))
    # enough rows that XLA gathers ZeRO-3 weights rather than moving activations
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), regression_batch(256))
    compiled, hlo = partitioned_hlo(plan.train_step(loss_fn).lower(state, batch))
    return plan, state, compiled, hlo


@pytest.fixture(scope="module")
def hsdp_programs():
    return {(str(dp), stage): _compile(dp, stage) for dp in [(2, 4), 8] for stage in (0, 1, 3)}


@pytest.mark.parametrize("stage", [1, 3])
def test_hsdp_hlo(hsdp_programs, stage):
    plan, state, compiled, hlo = hsdp_programs[("(2, 4)", stage)]
    shape = dict(plan.mesh.shape)
    ops = collectives(hlo)
    gathers = [spanned_axes(c.groups, shape) for c in ops if c.kind == "all-gather"]
    assert gathers and all(axes == ("dp",) for axes in gathers), gathers  # weights gathered inside a group only
    param_bytes = sum(x.size * 2 for x in jax.tree.leaves(state.params))  # bf16
    comm = count_collectives(hlo, shape)
    across = comm.volume_across("replica")
    # one all-reduce of the bf16 gradient shards across the two groups (volume 2x), plus a few scalars
    assert 0 < across <= 2 * param_bytes / 4 + 1024
    _, _, _, zero3 = hsdp_programs[("8", 3)]
    # what ZeRO-3 over all 8 devices sends across the same replica boundary (devices 0-3 | 4-7)
    assert across < count_collectives(zero3, shape).volume_across("replica")


@pytest.mark.parametrize("stage", [1, 3])
def test_hsdp_state_is_dp_state_over_the_shard_size(hsdp_programs, stage):
    _, _, dp_compiled, _ = hsdp_programs[("8", 0)]
    plan, state, compiled, _ = hsdp_programs[("(2, 4)", stage)]
    dp_state = dp_compiled.memory_analysis().argument_size_in_bytes
    got = compiled.memory_analysis().argument_size_in_bytes
    batch = 256 * 32 * 4 * 2 // 8  # x and y rows on one device
    if stage == 3:  # the whole state sharded over the 4-device group: DP's state / 4
        assert got - batch == pytest.approx((dp_state - batch) / 4, rel=0.01)
    report = plan.train_step(linen_mlp_task()[1]).memory_report(state, regression_batch(256), compiled)
    assert report.state_compiled == pytest.approx(report.state_theory, rel=0.01)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hsdp_trains_like_dp(stage):
    init_fn, loss_fn = linen_mlp_task()
    runs = {}
    for dp in [8, (2, 4)]:
        plan = zjax.Plan(zjax.make_mesh(dp=dp), stage=stage, precision="fp32")
        state = plan.init(init_fn, optax.adamw(1e-2), jax.random.key(0))
        step = plan.train_step(loss_fn)
        losses = []
        for i in range(4):
            state, m = step(state, plan.shard_batch(regression_batch(32, seed=i)))
            losses.append(float(m["loss"]))
        runs[str(dp)] = (losses, jax.device_get(state.params))
    np.testing.assert_allclose(runs["8"][0], runs["(2, 4)"][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(runs["8"][1]), jax.tree.leaves(runs["(2, 4)"][1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
