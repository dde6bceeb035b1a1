"""The core of zjax: a plan, the training state it lays out, and the steps that train it.

Below the core: ``zjax.sharding``, ``zjax.stages``, ``zjax.offload``, ``zjax.comm``, ``zjax.pipeline``; above it:
checkpoints, the planner, Hugging Face I/O, the notebook and the command line.
"""

from ._layout import StateLayout as StateLayout
from ._loss_scale import DynamicLossScale as DynamicLossScale
from ._loss_scale import LossScaleState as LossScaleState
from ._memory import MemoryReport as MemoryReport
from ._plan import Plan as Plan
from ._precision import PRECISIONS as PRECISIONS
from ._precision import Precision as Precision
from ._state import MixedPrecisionState as MixedPrecisionState
from ._state import TrainState as TrainState
from ._state import Variables as Variables
from ._step import EvalStep as EvalStep
from ._step import TrainStep as TrainStep
