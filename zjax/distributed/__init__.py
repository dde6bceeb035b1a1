"""Multi-process jobs: read the cluster, start JAX's runtime with safe timeouts, launch locally.

Example (the same script on a laptop, under ``srun``, ``mpirun`` or in a Kubernetes Indexed Job)::

    import zjax
    zjax.distributed.initialize()          # first: before anything touches a JAX backend
    mesh = zjax.make_mesh(dp=(-1, 8))      # HSDP: shard inside an 8-GPU node, replicate across nodes
"""

from ._cluster import DETECTORS as DETECTORS
from ._cluster import ClusterEnv as ClusterEnv
from ._cluster import ClusterError as ClusterError
from ._cluster import detect as detect
from ._initialize import Timeouts as Timeouts
from ._initialize import cluster as cluster
from ._initialize import initialize as initialize
from ._launch import PEER_FAILED as PEER_FAILED
from ._launch import free_port as free_port
from ._launch import launch as launch
