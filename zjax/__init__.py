"""zjax: train large models with JAX/XLA without running out of accelerator memory."""

from ._quiet import import_jax as _import_jax

_import_jax()  # first, where zjax is the first to import JAX: without the CUDA plugin's driver-probe lines

from . import checkpoint as checkpoint
from . import comm as comm
from . import context as context
from . import core as core
from . import data as data
from . import distributed as distributed
from . import experts as experts
from . import fp8 as fp8
from . import hf as hf
from . import metrics as metrics
from . import models as models
from . import notebook as notebook
from . import offload as offload
from . import pallas as pallas
from . import pipeline as pipeline
from . import planner as planner
from . import remat as remat
from . import sharding as sharding
from . import stages as stages
from . import train as train
from ._jsonfile import write_json_atomic as write_json_atomic
from ._version import __version__ as __version__
from .checkpoint import Checkpointer as Checkpointer
from .core import PRECISIONS as PRECISIONS
from .core import DynamicLossScale as DynamicLossScale
from .core import EvalStep as EvalStep
from .core import LossScaleState as LossScaleState
from .core import LossSum as LossSum
from .core import MemoryReport as MemoryReport
from .core import MixedPrecisionState as MixedPrecisionState
from .core import Plan as Plan
from .core import Precision as Precision
from .core import StateLayout as StateLayout
from .core import TrainState as TrainState
from .core import TrainStep as TrainStep
from .core import Variables as Variables
from .offload import Offload as Offload
from .pipeline import Pipeline as Pipeline
from .sharding import Rules as Rules
from .sharding import make_mesh as make_mesh
from .sharding import shard_batch as shard_batch
from .sharding import simulate_cpu_devices as simulate_cpu_devices
from .stages import STAGES as STAGES
from .stages import Stage as Stage

__all__ = [
    "checkpoint",
    "comm",
    "context",
    "core",
    "data",
    "distributed",
    "experts",
    "fp8",
    "hf",
    "make_mesh",
    "metrics",
    "models",
    "notebook",
    "offload",
    "pallas",
    "pipeline",
    "planner",
    "remat",
    "shard_batch",
    "sharding",
    "simulate_cpu_devices",
    "stages",
    "train",
    "write_json_atomic",
    "Checkpointer",
    "DynamicLossScale",
    "EvalStep",
    "LossScaleState",
    "LossSum",
    "MemoryReport",
    "MixedPrecisionState",
    "Offload",
    "PRECISIONS",
    "Pipeline",
    "Plan",
    "Precision",
    "Rules",
    "STAGES",
    "Stage",
    "StateLayout",
    "TrainState",
    "TrainStep",
    "Variables",
]
