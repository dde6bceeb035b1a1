"""Whether an optax update is elementwise: each output element depends only on the same element of each
parameter-shaped input (and on scalars such as the step count). Only such an update may run chunk by
chunk; Adam, AdamW, Lion, SGD with momentum and schedules are; a global-norm clip or a factored
second moment (Adafactor) are not, and streaming them would silently change the result.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jcore

_ELEMENTWISE = frozenset(
    [
        "abs",
        "acos",
        "acosh",
        "add",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "imag",
        "integer_pow",
        "is_finite",
        "le",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "or",
        "pow",
        "real",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "sub",
        "tan",
        "tanh",
        "xor",
    ]
)
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr")


def _sub_jaxprs(eqn: Any):
    for name in _CALLS:
        sub = eqn.params.get(name)
        if sub is not None:
            yield getattr(sub, "jaxpr", sub)
    for branch in eqn.params.get("branches", ()):
        yield getattr(branch, "jaxpr", branch)


def _ndim(var: Any) -> int:
    return len(getattr(getattr(var, "aval", None), "shape", ()))


def _first_cross_element(jaxpr: Any) -> str | None:
    for eqn in jaxpr.eqns:
        subs = list(_sub_jaxprs(eqn))
        if subs:
            if eqn.primitive.name in ("while", "scan") and any(_ndim(v) for v in eqn.invars):
                return eqn.primitive.name  # a loop over array elements
            for sub in subs:
                found = _first_cross_element(sub)
                if found:
                    return found
            continue
        arrays = [v for v in (*eqn.invars, *eqn.outvars) if not isinstance(v, jcore.Literal) and _ndim(v)]
        if not arrays:
            continue  # scalar bookkeeping: counts, schedules, bias corrections
        name = eqn.primitive.name
        if name in _ELEMENTWISE:
            continue
        if name == "broadcast_in_dim" and not _ndim(eqn.invars[0]):
            continue  # a scalar spread over an array
        return name
    return None


def cross_element_op(update: Any, *args: Any) -> str | None:
    """The first primitive of ``update(*args)`` (abstract args) that mixes elements of an array, or None."""
    jaxpr = jax.make_jaxpr(update)(*args)
    return _first_cross_element(jaxpr.jaxpr)
