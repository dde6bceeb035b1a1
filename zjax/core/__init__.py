"""The core of zjax: a plan, the training state it lays out, and the steps that train it.

Its modules import downward only; each may import those on its left, never those on its right:

``_html``, ``_precision``, ``_loss_scale``, ``_loss_fn``, ``_objective`` (what a step minimises), ``_overlap``
(leaves) -> ``_rows`` (a layout's per-leaf rows and HTML) -> ``_state`` -> ``_layout`` -> ``_memory`` (the memory
report) -> ``_config`` (a plan's checked settings) -> ``_per_rank`` -> ``_compiled`` (what the steps share; the eval
step) -> ``_step`` -> ``_plan``.

Below the core: ``zjax.sharding``, ``zjax.stages``, ``zjax.offload``, ``zjax.comm``, ``zjax.pipeline``. Above it:
``zjax.checkpoint``, ``zjax.planner``, ``zjax.hf``, ``zjax.notebook`` and the command line; they import the core,
never the reverse (the core renders its own HTML tables).
"""

from ._layout import StateLayout as StateLayout
from ._loss_scale import DynamicLossScale as DynamicLossScale
from ._loss_scale import LossScaleState as LossScaleState
from ._memory import MemoryReport as MemoryReport
from ._objective import LossSum as LossSum
from ._plan import Plan as Plan
from ._precision import PRECISIONS as PRECISIONS
from ._precision import Precision as Precision
from ._state import MixedPrecisionState as MixedPrecisionState
from ._state import TrainState as TrainState
from ._state import Variables as Variables
from ._step import EvalStep as EvalStep
from ._step import TrainStep as TrainStep
