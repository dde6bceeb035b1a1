"""The mesh axis names: the one place they are spelled."""

from __future__ import annotations

REPLICA = "replica"
"""Hybrid sharded data parallelism (HSDP): the batch is split over it, model state is replicated over it.

Size 1 unless ``zjax.make_mesh(dp=(replica, shard))`` asks for HSDP; it is the outer part of data
parallelism and the axis meant to cross nodes."""
DP = "dp"
"""Data parallel axis (the HSDP shard axis): the batch is split over it; ZeRO stages shard model state over it."""
CP = "cp"
"""Context parallel axis: each sequence is split along its length over it for the whole layer stack.

Its ranks hold the same parameters (they see different tokens of the same rows), so gradients are reduced over
it and ZeRO shards model state over ``dp x cp`` (and ``ep``, :data:`ZERO_AXES`)."""
EP = "ep"
"""Expert parallel axis: the experts of a mixture-of-experts layer are split over it (logical name ``expert``)
and tokens reach their experts by an all-to-all over it.

For everything else it is a data axis: the batch is split over it and ZeRO shards the other parameters' state over
it (:data:`DATA_AXES`, :data:`ZERO_AXES`), so ``dp x ep`` devices hold a dense model the way ``dp x ep`` data
ranks would, and an expert's weights are replicated only over ``dp`` (which ZeRO then shards)."""
TP = "tp"
"""Tensor parallel axis: parameters are split over it by logical-axis rules."""
PP = "pp"
"""Pipeline parallel axis: layer stages are placed along it."""

MESH_AXES: tuple[str, ...] = (PP, REPLICA, DP, EP, CP, TP)
"""Axis order of every zjax mesh, outermost first: the axes with the heaviest collectives innermost (tp, then cp,
then ep's all-to-alls) so that they land on the closest devices."""

DATA_AXES: tuple[str, ...] = (REPLICA, DP, EP)
"""The axes the batch is split over, outermost first."""

ZERO_AXES: tuple[str, ...] = (DP, EP, CP)
"""The axes ZeRO shards model state over: ranks along them hold the same parameters and see different tokens (an
expert's weights, split over ``ep`` already, take only the others)."""
