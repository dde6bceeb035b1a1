"""Optional dependencies: which extra brings each, and one error that names the pip command.

zjax imports an optional package only where it is used; :func:`require` checks for it before any work starts (a
command checks every one its options need before compiling anything) and raises :class:`MissingExtra`, an
``ImportError`` whose message is one line: what needs it and ``pip install "zjax[extra]"``.
"""

from __future__ import annotations

import importlib.util

EXTRAS: dict[str, str] = {
    "safetensors": "hf",
    "tokenizers": "data",
    "pyarrow": "parquet",
    "tensorboardX": "tensorboard",
    "wandb": "wandb",
    "matplotlib": "plot",
    "ipykernel": "notebook",
    "jax_plugins.xla_cuda12": "plan-gpu",
}
"""The importable module -> the extra of ``pyproject.toml`` that installs it."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra and its pip command."""


def require(module: str, needed_by: str) -> None:
    """Raise :class:`MissingExtra` unless ``module`` can be imported.

    Args:
      module: a key of :data:`EXTRAS`.
      needed_by: what needs it, for the message (``"--plot"``, ``"zjax.hf.load"``).
    """
    if _found(module):
        return
    raise MissingExtra(f'{needed_by} needs {module.split(".")[-1]}: pip install "zjax[{EXTRAS[module]}]"')


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing (jax_plugins)
        return False
