"""Meshes, parameter-placement rules and batch sharding."""

from ._annotations import Leaf as Leaf
from ._annotations import path_str as path_str
from ._annotations import read_leaves as read_leaves
from ._annotations import unbox as unbox
from ._axes import DP as DP
from ._axes import MESH_AXES as MESH_AXES
from ._axes import PP as PP
from ._axes import TP as TP
from ._batch import batch_shardings as batch_shardings
from ._batch import batch_spec as batch_spec
from ._batch import check_batch as check_batch
from ._batch import shard_batch as shard_batch
from ._mesh import axis_size as axis_size
from ._mesh import make_mesh as make_mesh
from ._rules import DEFAULT_LOGICAL_RULES as DEFAULT_LOGICAL_RULES
from ._rules import Rules as Rules
