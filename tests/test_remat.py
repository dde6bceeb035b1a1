"""Remat policies: registry, equal gradients, memory/FLOPs trade-off, offload, stage-3 liveness."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zjax
from zjax.models import DecoderConfig
from zjax.remat import POLICIES, RematPolicy

from ._models import TINY, decoder_task, token_batch, train
from .test_gpu_plan import _figure


def grad_program(policy: str, cfg: DecoderConfig = TINY):
    init_fn, loss_fn = decoder_task(dataclasses.replace(cfg, remat=policy))
    params = init_fn(jax.random.key(0))
    batch = jnp.asarray(token_batch(8, cfg))
    fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b).mean))
    return fn, params, batch


@pytest.fixture(scope="module")
def reference_grads():
    fn, params, batch = grad_program("none")
    return jax.device_get(fn(params, batch))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_registry_round_trip(name):
    policy = RematPolicy.from_str(name)
    assert policy.name == name and RematPolicy.from_str(policy) is policy
    assert policy.partition == name.endswith("+partitioned")


# Partitioned twins compile to the same single-device program; their numerics under tp are tested below.
# One policy of each kind runs in the fast suite (nested too: its training test is slow), the rest in the slow step.
FAST = ("full", "dots", "minimal", "nested")


@pytest.mark.parametrize(
    "name",
    [
        n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(POLICIES)
        if not POLICIES[n].partition
    ],
)
def test_equal_gradients(name, reference_grads):
    fn, params, batch = grad_program(name)
    grads = jax.device_get(fn(params, batch))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


# Every policy's gradients equal no remat's (test_equal_gradients; partitioned twins below): here one policy of
# each remaining mechanism (nested, offloaded names) trains the Decoder at stage 3; the partitioned one trains there
# in test_partitioned_checkpoints_train_identically (on dp=4 x tp=2, where it partitions, to full remat's losses).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["nested", "offload_minimal"])
def test_each_remaining_mechanism_trains_the_decoder_at_stage_3(name):
    cfg = dataclasses.replace(TINY, remat=name)
    losses, state, _ = train(decoder_task(cfg), [token_batch(16, cfg, seed=i) for i in range(2)], stage=3)
    assert int(state.step) == 2 and all(np.isfinite(losses))


def test_temp_and_flops_trade_off():
    """Saving more keeps more temporaries and recomputes less: none >= dots >= full in temporaries, the reverse in
    FLOPs. Read from the figure on docs/concepts/remat.md (benchmarks/remat.py: each policy's compiled step of the
    small LM, stage 3 on dp=8; recomputed by CI's docs/figures.py --check)."""
    text = _figure("docs/concepts/remat.md", "benchmarks/remat.py --preset small --stage 3 --mesh dp=8")
    stats = {}  # policy -> (temporaries per device in MiB, FLOPs relative to none)
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0] in ("none", "dots", "full"):
            stats[cells[0]] = (float(cells[1]), float(cells[4]))
    assert set(stats) == {"none", "dots", "full"}, text
    temp = {k: v[0] for k, v in stats.items()}
    flops = {k: v[1] for k, v in stats.items()}
    assert temp["none"] >= temp["dots"] >= temp["full"], temp
    assert flops["none"] <= flops["dots"] <= flops["full"], flops
    assert temp["full"] < temp["none"] and flops["full"] > flops["none"]


def test_unknown_and_invalid_policies():
    with pytest.raises(ValueError, match=r"Unknown remat policy 'fancy'; valid names are \['dots'"):
        RematPolicy.from_str("fancy")
    with pytest.raises(ValueError, match="silently offloads nothing to 'unpinned_host'"):
        RematPolicy("x", "names", offload=("qkv_proj",), offload_dst="unpinned_host")
    with pytest.raises(ValueError, match="cannot be both saved and offloaded"):
        RematPolicy.custom(save=("qkv_proj",), offload=("qkv_proj",))
    with pytest.raises(ValueError, match="need kind='names'"):
        RematPolicy("x", "full", save=("qkv_proj",))


def test_custom_policy_equals_reference(reference_grads):
    policy = RematPolicy.custom(save=("out_proj",), offload=("mlp_in",))
    assert policy.jax_policy() is not None
    cfg = dataclasses.replace(TINY, remat="none")
    init_fn, loss_fn = decoder_task(cfg)
    # wrap the whole loss with the custom policy: results must not change
    fn = jax.jit(jax.grad(jax.checkpoint(lambda p, b: loss_fn(p, b).mean, policy=policy.jax_policy())))
    grads = fn(init_fn(jax.random.key(0)), jnp.asarray(token_batch(8)))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.slow  # a GPU compile; the fast suite keeps the state's pinned_host placements on the GPU target
def test_offload_policy_places_names_on_pinned_host_for_cuda():
    """CPU compiles drop host placements, so check the CUDA lowering of the offloading step."""
    placement = re.compile(r'_xla_buffer_placement = "pinned_host"\}\} : \(tensor<([0-9x]+)xf32>\)')

    def offloaded_shapes(policy: str) -> list[str]:
        fn, params, batch = grad_program(policy)
        return placement.findall(jax.export.export(fn, platforms=["cuda"])(params, batch).mlir_module())

    qkv = f"8x{TINY.max_len}x{TINY.heads}x{TINY.head_dim}"  # [batch, seq, heads, head_dim]
    assert offloaded_shapes("offload_qkv_proj") == [qkv] * 3  # q, k and v of the scanned layer
    assert offloaded_shapes("save_qkv_proj") == []


LIVENESS = DecoderConfig(vocab=64, embed=256, layers=4, heads=4, head_dim=64, mlp=1024, max_len=16, remat="full")


def stage3_temp(layers: int, scan: bool) -> tuple[int, int]:
    """Compiled temp bytes of the fp32 stage-3 step, and the bytes of its dp-sharded gradients."""
    cfg = dataclasses.replace(LIVENESS, layers=layers, scan=scan)
    init_fn, loss_fn = decoder_task(cfg)
    plan = zjax.Plan(zjax.make_mesh(dp=8), stage=3, precision="fp32")
    state = plan.abstract_state(init_fn, optax.sgd(0.1), jax.random.key(0))
    report = plan.train_step(loss_fn).memory_report(state, jax.ShapeDtypeStruct((16, cfg.max_len + 1), np.int32))
    return report.temp_bytes, report.theory["gradients"]


@pytest.mark.slow
def test_stage3_liveness_scanned_is_flat_unrolled_grows():
    """Scanned layers + full remat gather one layer at a time; unrolled layers keep every gathered layer alive.

    Temporaries hold the dp-sharded gradients (4 psi / N, which grow with depth by design); the rest must
    not grow. Measured (fp32, 256-wide, dp=8): scanned 4 -> 8 layers stays flat after the gradients;
    unrolled grows by about the gathered weights of the extra layers.
    """
    (s4, g4), (s8, g8) = stage3_temp(4, True), stage3_temp(8, True)
    (u4, _), (u8, _) = stage3_temp(4, False), stage3_temp(8, False)
    layer_bytes = 4 * (4 * 256 * 4 * 64 + 3 * 256 * 1024)
    assert (s8 - g8) <= 1.1 * (s4 - g4), (s4, s8, g4, g8)
    # at most ~two gathered layers (params + grads) beyond the sharded gradients
    assert s8 - g8 <= 1.25 * 2 * 2 * layer_bytes
    # the pitfall: unrolled temp grows by roughly one gathered layer per extra layer
    assert u8 - u4 >= 0.75 * 4 * layer_bytes, (u4, u8)
    assert u8 > 1.5 * s8


class NnxLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(x)))


class NnxStack(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs, policy: str = "full"):
        self.layers = zjax.remat.nnx_stack(NnxLayer, layers, rngs)
        self.policy = policy

    def __call__(self, x):
        return zjax.remat.nnx_scan(self.layers, x, self.policy)


def test_nnx_scan_helpers_stack_layers_and_train_under_stage3():
    with nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: NnxStack(4, nnx.Rngs(0))))

    def init_fn(rng):
        return nnx.split(NnxStack(4, nnx.Rngs(rng)), nnx.Param)[1]

    def loss_fn(params, batch):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

    rs = np.random.RandomState(0)
    data = [{"x": rs.randn(16, 32).astype(np.float32), "y": rs.randn(16, 32).astype(np.float32)}] * 4
    losses, state, _ = train((init_fn, loss_fn), data, stage=3, mesh=zjax.make_mesh(dp=4, tp=2))
    kernel = state.params["layers"]["up"]["kernel"]
    assert kernel.shape == (4, 32, 64)  # stacked on the leading layers axis
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "dp", "tp")
    assert losses[-1] < losses[0]


def test_linen_scan_stacks_with_layers_name():
    init_fn, _ = decoder_task()
    with nnx.use_eager_sharding(False):
        leaves = zjax.sharding.read_leaves(jax.eval_shape(init_fn, jax.random.key(0)))
    wq = next(leaf for leaf in leaves if leaf.path.endswith("layers/wq"))
    assert wq.names == ("layers", "embed", "heads", "head_dim") and wq.shape[0] == TINY.layers


def _stacked_residual_shapes(policy: str, sequence_parallel: bool = False) -> tuple[set[str], int]:
    cfg = dataclasses.replace(TINY, layers=4, max_len=64, remat=policy)
    init_fn, loss_fn = decoder_task(cfg)
    rules = zjax.Rules(sequence_parallel=sequence_parallel)
    plan = zjax.Plan(zjax.make_mesh(dp=4, tp=2), stage=1, precision="fp32", rules=rules)
    state = plan.abstract_state(init_fn, optax.sgd(0.1), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((16, cfg.max_len + 1), np.int32)
    compiled = plan.train_step(loss_fn).lower(state, batch).compile()
    # the residual stack saved by the scan: [layers, batch / dp, seq (/ tp), embed]
    shapes = set(re.findall(rf"f32\[{cfg.layers},4,\d+,{cfg.embed}\]", compiled.as_text()))
    return shapes, compiled.memory_analysis().temp_size_in_bytes


def test_partitioned_checkpoints_halve_saved_activations_with_tp2():
    replicated, _ = _stacked_residual_shapes("full")
    partitioned, _ = _stacked_residual_shapes("full+partitioned")
    assert replicated == {"f32[4,4,64,64]"}  # every tp rank saves the whole sequence
    assert partitioned == {"f32[4,4,32,64]"}  # each tp rank saves its half
    # sequence parallelism (the default rules) saves the layer inputs split over tp without ZeRO-R's gathers
    assert _stacked_residual_shapes("full", sequence_parallel=True)[0] == {"f32[4,4,32,64]"}


@pytest.mark.slow
def test_partitioned_checkpoints_train_identically():
    data = [token_batch(16, seed=i) for i in range(3)]
    mesh = zjax.make_mesh(dp=4, tp=2)
    ref, _, _ = train(decoder_task(dataclasses.replace(TINY, remat="full")), data, stage=3, mesh=mesh)
    got, _, _ = train(decoder_task(dataclasses.replace(TINY, remat="full+partitioned")), data, stage=3, mesh=mesh)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
