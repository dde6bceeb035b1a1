"""Which devices a collective's groups hold, and the mesh axes those groups span."""

from __future__ import annotations

import math
import re

import numpy as np

_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\))?\s*\{([^}]*)\}"
)


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective's ``replica_groups`` (every HLO text format), as partition ids.

    Formats: ``{{0,1},{2,3}}``; the iota form ``[G,S]<=[dims]T(perm)``; the mesh form
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` with an optional ``device_ids=([dims]T(perm))``;
    and ``{}`` (one group of all devices).
    """
    m = _MESH_GROUPS.search(attrs)
    if m:
        pairs = re.findall(r"'?([\w.]+)'?=(\d+)", m.group(1))
        names, sizes = [n for n, _ in pairs], [int(v) for _, v in pairs]
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) or None) if m.group(2) else np.arange(math.prod(sizes))
        ids = ids.reshape(sizes)
        over = [names.index(a.strip().strip("'")) for a in m.group(4).split(",") if a.strip()]
        rest = [i for i in range(len(names)) if i not in over]
        size = math.prod(sizes[i] for i in over)
        return ids.transpose(rest + over).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?", attrs)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", attrs)
    if m and m.group(1):
        return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    permute = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if permute:
        return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", permute.group(1))]
    return [list(range(num_devices))]


def spanned_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which some group's devices differ (partition id = position in the mesh)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varies = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group), sizes)).T
        varies |= {names[i] for i in range(len(names)) if len(set(coords[:, i].tolist())) > 1}
    return tuple(n for n in names if n in varies)
