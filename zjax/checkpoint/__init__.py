"""Checkpoints that survive crashes and restore into any stage, mesh or process count (orbax)."""

from ._checkpointer import Checkpointer as Checkpointer
from ._checkpointer import plan_metadata as plan_metadata
from ._recovery import RestoreError as RestoreError
