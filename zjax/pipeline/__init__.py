"""Pipeline parallelism over the mesh axis ``pp``: GPipe, circular, 1F1B, interleaved 1F1B, zero-bubble and ZB-V.

Example (inside a model's loss; the plan sets the schedule)::

    plan = zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3,
                     pipeline=zjax.Pipeline(microbatches=8, schedule="1f1b"))
    total = zjax.pipeline.loss(stage_fn, params["layers"], batch,     # stage_fn(stage_layers, h) -> h
                               first=embed, last=nll_sum, params=edge)      # first(edge, mb), last(edge, h, mb)

``zjax.pipeline.apply(stage_fn, layers, h)`` runs the layers alone (GPipe and circular schedules).
"""

from ._config import GATHER_MODES as GATHER_MODES
from ._config import RECOMPUTE as RECOMPUTE
from ._config import TABLE_SCHEDULES as TABLE_SCHEDULES
from ._config import Pipeline as Pipeline
from ._context import current as current
from ._context import initializing as initializing
from ._context import use as use
from ._engine import apply as apply
from ._engine import scan_layers as scan_layers
from ._loss import loss as loss
from ._scan import ITERATION_INPUT as ITERATION_INPUT
from ._schedule import PLACEMENTS as PLACEMENTS
from ._schedule import SCHEDULES as SCHEDULES
from ._schedule import Table as Table
from ._schedule import parse_table as parse_table
from ._schedule import read_table as read_table
from ._schedule import schedule_table as schedule_table
from ._ticks import ACTION_SCOPE as ACTION_SCOPE
from ._ticks import ENDS_SCOPE as ENDS_SCOPE
from ._ticks import seed as seed
