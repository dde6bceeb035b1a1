"""ZeRO-Offload: the optimizer state (and at stage 3 the parameters) in host memory, streamed for the update.

``zjax.Plan(..., offload="optimizer")`` places the fp32 master weights and every optimizer-state leaf in
``pinned_host`` memory; the train step streams them through the device in bounded chunks
(:func:`streamed_update`). ``"optimizer+params"`` (stage 3) keeps the compute parameters' shards there too.
"""

from ._config import HOST, Offload
from ._update import chunk_rows, streamed_update

__all__ = ["HOST", "Offload", "chunk_rows", "streamed_update"]
