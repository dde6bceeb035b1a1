"""Device setup for the whole suite: 8 simulated CPU devices, set before any backend starts."""

import os

# The CUDA compiler plugin (installed for the deviceless GPU planner tests) must not look for a GPU: the CPU
# platform here, and in every process the tests start (examples, workers), inherits it.
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402

import zjax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
zjax.simulate_cpu_devices(8)  # with XLA:CPU threads enough for their collectives (zjax.sharding._simulate)

NUM_DEVICES = 8


@pytest.fixture(autouse=True, scope="session")
def _enough_devices():
    if jax.device_count() < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, found {jax.device_count()} (backend started before conftest?)")
