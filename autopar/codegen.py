"""Codegen: a plan becomes a ``jax.jit`` executable.

The traced jaxpr is evaluated again, equation by equation, inside ``jax.jit`` with
``in_shardings``/``out_shardings`` from the plan; after each equation the plan pins
(dot_generals, convolutions, gathers at the top level) its output gets a
``with_sharding_constraint``. ``jit`` calls are entered so pins inside them apply; other calls
(remat, custom_jvp/vjp, scan, while, cond) are bound whole, keeping their semantics, and XLA
propagates layouts into them from their pinned operands. The numbers are the user's own
program: only layouts change.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding

from autopar.sharding import to_spec

_CALLS = ("jit", "pjit", "closed_call", "core_call")


def _read(env, v):
    return v.val if type(v).__name__ == "Literal" else env[v]


def _bind(eqn, invals):
    got = eqn.primitive.get_bind_params(eqn.params)
    # jax 0.10 returns the params; older releases returned (subfuns, params).
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    ctx = getattr(eqn, "ctx", None)
    if ctx is not None and hasattr(ctx, "manager"):
        with ctx.manager:
            return eqn.primitive.bind(*subfuns, *invals, **params)
    return eqn.primitive.bind(*subfuns, *invals, **params)


def eval_pinned(jaxpr, consts: Sequence, args: Sequence, pins: dict, mesh, path=()):
    """Evaluate ``jaxpr`` like ``jax.core.eval_jaxpr``, constraining pinned outputs."""
    env = {}
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        invals = [_read(env, v) for v in eqn.invars]
        if eqn.primitive.name in _CALLS and "jaxpr" in eqn.params and any(
                p[: len(here)] == here for p, _ in pins):
            inner = eqn.params["jaxpr"]
            outs = eval_pinned(inner.jaxpr, inner.consts, invals, pins, mesh, here)
        else:
            outs = _bind(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for k, (v, x) in enumerate(zip(eqn.outvars, outs)):
            spec = pins.get((here, k))
            if spec is not None:
                x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
            env[v] = x
    return [_read(env, v) for v in jaxpr.outvars]


def build(graph, plan, mesh, donate_argnums=()):
    """The jitted, sharded executable of ``graph``'s function under ``plan`` on ``mesh``."""
    pins = {(tuple(p), k): to_spec(s) for p, k, s in plan.pins}
    closed = graph.jaxpr
    in_shardings = jax.tree_util.tree_unflatten(
        graph.in_tree, [NamedSharding(mesh, to_spec(s)) for s in plan.input_shardings])
    out_shardings = jax.tree_util.tree_unflatten(
        graph.out_tree, [NamedSharding(mesh, to_spec(s)) for s in plan.output_shardings])

    def step(*args):
        flat = jax.tree_util.tree_leaves(args)
        outs = eval_pinned(closed.jaxpr, closed.consts, flat, pins, mesh)
        return jax.tree_util.tree_unflatten(graph.out_tree, outs)

    # in_tree is the tree of the argument tuple: jit wants one entry per positional argument.
    return jax.jit(step, in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                   donate_argnums=donate_argnums), in_shardings
