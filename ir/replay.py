"""Replaying a jaxpr's equations under a new trace, keeping the user's source lines.

Shared by the passes that rewrite a traced step (``ir.recompute``) and by codegen, which replays
the step with its sharding constraints: each equation is bound again with its own parameters,
inside its own context manager (e.g. a ``jax.named_scope``) and under its own source line and
name stack, so the new jaxpr's layers (``ir.layers``) and the compiled HLO's metadata still
point at the user's model.
"""
from __future__ import annotations

import contextlib

from jax.extend import core as jcore


def is_drop(v) -> bool:
    """Whether ``v`` is an output jax discards (``_`` in a printed jaxpr)."""
    return isinstance(v, jcore.DropVar)


def batched_dot(eqn) -> bool:
    """Whether a ``dot_general`` has batch dimensions (attention's per-head matmuls do; a
    layer's matmuls with its weights do not)."""
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return bool(lhs_batch)


def read(env, v):
    """The value of ``v`` (a jaxpr variable or literal) in ``env``."""
    return v.val if isinstance(v, jcore.Literal) else env[v]


def bind(eqn, invals, params=None):
    """``eqn``'s primitive bound to ``invals`` (with ``params`` in place of its own)."""
    got = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    # jax 0.10 returns the params; older releases returned (subfuns, params).
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and hasattr(ctx, "manager"):
        with ctx.manager:
            return eqn.primitive.bind(*subfuns, *invals, **params)
    return eqn.primitive.bind(*subfuns, *invals, **params)


def user_context(eqn):
    """A context under which new equations carry ``eqn``'s source line and name stack."""
    try:
        from jax._src import source_info_util as siu
    except ImportError:   # private module: without it the metadata names the replaying code
        return contextlib.nullcontext()
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    return siu.user_context(eqn.source_info.traceback, name_stack=name_stack)


def replay(eqn, invals) -> list:
    """``eqn`` bound to ``invals`` under its own source context; its outputs as a list."""
    with user_context(eqn):
        out = bind(eqn, invals)
    return list(out) if eqn.primitive.multiple_results else [out]
