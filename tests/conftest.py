"""Device setup for the whole suite: 8 simulated CPU devices, set before any backend starts."""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8


@pytest.fixture(autouse=True, scope="session")
def _enough_devices():
    if jax.device_count() < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, found {jax.device_count()} (backend started before conftest?)")
