"""ZeRO stages 0-3 as data, and the spec trees they give."""

from ._layout import Layout as Layout
from ._layout import Placement as Placement
from ._layout import Unsharded as Unsharded
from ._placement import add_axis as add_axis
from ._placement import shard_count as shard_count
from ._stage import STAGES as STAGES
from ._stage import Stage as Stage
