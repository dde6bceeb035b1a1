"""Looking at a plan in Jupyter: per-leaf tables and plots of placement, memory and communication.

``zjax.StateLayout``, ``zjax.TrainState``, ``zjax.MemoryReport`` and the planner's ``Estimate`` render
as HTML tables in a notebook (``_repr_html_``); each renders itself, and the functions are re-exported here.
The plots need matplotlib (``pip install "zjax[notebook]"``).
"""

from ..core._memory import memory_report_html
from ..core._rows import LeafRow, layout_html, layout_rows
from ..planner._result import estimate_html
from ._plots import plot_comm, plot_memory, plot_mesh

__all__ = [
    "LeafRow",
    "estimate_html",
    "layout_html",
    "layout_rows",
    "memory_report_html",
    "plot_comm",
    "plot_memory",
    "plot_mesh",
]
