"""Pipeline parallelism over the mesh axis ``pp``: GPipe and circular schedules inside one ``lax.scan``.

Example (inside a model's forward pass; the plan sets the schedule)::

    plan = zjax.Plan(zjax.make_mesh(dp=2, pp=4), stage=3, pipeline=zjax.Pipeline(microbatches=8))
    h = zjax.pipeline.apply(stage_fn, params["layers"], h)    # stage_fn(stage_layers, h) -> h
"""

from ._config import GATHER_MODES as GATHER_MODES
from ._config import Pipeline as Pipeline
from ._engine import ITERATION_INPUT as ITERATION_INPUT
from ._engine import apply as apply
from ._engine import current as current
from ._engine import scan_layers as scan_layers
from ._engine import use as use
