"""Print a hash of the compiled step for XLA:CPU (8 simulated devices) and for 8 H100s (deviceless).

``python -m tests._compile_fingerprint_worker simulate|plain``: ``simulate`` starts the backend with
``zjax.simulate_cpu_devices(8)``, ``plain`` with ``jax_num_cpu_devices`` alone (XLA:CPU's default threads);
tests/test_cpu_simulation.py checks that both compile the same programs. XLA:CPU splits each elementwise loop
into as many tasks as it has threads (``outer_dimension_partitions`` in a fusion's backend config): those
counts are left out of the CPU hash, which covers every instruction, shape and buffer; its memory is printed.
"""

import hashlib
import re
import sys

import jax
import jax.numpy as jnp
import optax

import zjax
from zjax.models import PRESETS, Decoder, lm_loss
from zjax.planner._gpu import cudnn_for_target, gpu_devices

jax.config.update("jax_platforms", "cpu")
if sys.argv[1] == "simulate":
    zjax.simulate_cpu_devices(8)
else:
    jax.config.update("jax_num_cpu_devices", 8)

cfg = PRESETS["tiny"]
model = Decoder(cfg)


def fingerprint(devices, target: str | None = None) -> tuple[str, str]:
    plan = zjax.Plan(zjax.make_mesh(dp=8, devices=devices), stage=3, precision="bf16")
    init = lambda r: model.init(r, jnp.zeros((1, cfg.max_len), jnp.int32))["params"]  # noqa: E731
    state = plan.abstract_state(init, optax.adamw(1e-3), jax.random.key(0))
    step = plan.train_step(lambda p, b: lm_loss(model, p, b))
    batch = jax.ShapeDtypeStruct((16, cfg.max_len + 1), jnp.int32)
    if target is None:
        compiled = step.lower(state, batch).compile()
    else:
        with cudnn_for_target(target):  # what the planner does for a GPU target
            compiled = step.lower(state, batch).compile()
    text = re.sub(r"HloModule \S+", "HloModule", compiled.as_text())  # the module's name carries a counter
    text = re.sub(r'"outer_dimension_partitions":\[[^\]]*\]', "", text)  # tasks per loop: the thread count
    m = compiled.memory_analysis()
    memory = f"{m.argument_size_in_bytes},{m.output_size_in_bytes},{m.alias_size_in_bytes},{m.temp_size_in_bytes}"
    return hashlib.sha256(text.encode()).hexdigest(), memory


print("cpu", *fingerprint(jax.devices()[:8]), flush=True)
print("gpu", *fingerprint(gpu_devices("h100", 8), "h100"), flush=True)
