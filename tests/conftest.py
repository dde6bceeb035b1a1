"""Device setup for the whole suite: 8 simulated CPU devices, set before any backend starts."""

import os

# The CUDA compiler plugin (installed for the deviceless GPU planner tests) must not look for a GPU: the CPU
# platform here, and in every process the tests start (examples, workers), inherits it.
os.environ["JAX_PLATFORMS"] = "cpu"

# The tests compile far more than they run: with LLVM's optimizations off XLA:CPU compiles their programs about
# 2.5x faster (a stage-3 step of the tiny decoder on 8 devices: 5.2 s against 12.7 s on a busy 2-core Xeon; the
# fast suite 679 s against 880 s), and every tolerance here holds for any CPU's code. Tests marked ``codegen``
# compare two compiled programs to the last bit, which holds with the default code generation only: they run where
# XLA_FLAGS names a level (CI: ``--xla_backend_optimization_level=3``, XLA's default) and are skipped otherwise.
# The processes the tests start inherit the flag.
_LEVEL = "--xla_backend_optimization_level"
if _LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LEVEL}=0".strip()
UNOPTIMIZED = f"{_LEVEL}=0" in os.environ["XLA_FLAGS"]

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


def pytest_collection_modifyitems(config, items):
    if UNOPTIMIZED:
        skip = pytest.mark.skip(reason=f"compares two programs bitwise: run with XLA_FLAGS={_LEVEL}=3")
        for item in items:
            if "codegen" in item.keywords:
                item.add_marker(skip)
