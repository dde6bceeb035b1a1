"""The mesh axis names: the one place they are spelled."""

from __future__ import annotations

DP = "dp"
"""Data parallel axis: the batch is split over it; ZeRO stages shard model state over it."""
TP = "tp"
"""Tensor parallel axis: parameters are split over it by logical-axis rules."""
PP = "pp"
"""Pipeline parallel axis: layer stages are placed along it."""

MESH_AXES: tuple[str, ...] = (PP, DP, TP)
"""Axis order of every zjax mesh, outermost first: tp is innermost so that it lands on the closest devices."""
