"""Codegen: a plan becomes a ``jax.jit`` executable that runs every layout the plan decided.

The traced jaxpr is evaluated again, equation by equation, inside ``jax.jit`` with the plan's
``in_shardings``/``out_shardings``. Each ``Pin`` of the plan (see ``autopar.planner.pins``) becomes
``with_sharding_constraint`` calls:

  * ``out`` pins constrain an equation's result to the layout its op runs under;
  * ``in`` pins move an operand to the layout its op needs, through the staged chain of layouts
    ``reshard_steps`` gives, each one a step XLA's partitioner performs directly (so no
    transition falls back to "involuntary full rematerialization"). A value that several
    equations read through the same chain is moved once and the moved value shared
    (``PinTable.constrain``), as the planner prices it (``Problem.edge_sets``): XLA's
    partitioner caches a reshard by the instruction it starts from, so only the first step of
    identical chains is shared on its own, and each reader's chain would repeat every later step
    (an MoE's dispatched tokens, gathered once, went through the all-to-all once for the forward
    expert dot and again for its weight gradient);
  * ``arg``/``res`` pins constrain a loop body's parameters and loop-carried results.

Pins reach everywhere: ``jit`` calls are entered; ``scan``/``while``/``cond`` bodies, ``remat``
(its policy kept) and ``custom_jvp``/``custom_vjp`` calls are retraced with their pins in place and
bound again with every other parameter unchanged. The numbers are the user's own program: only
layouts change. The step's own ``with_sharding_constraint`` calls are layouts too: where the
plan pins the value one constrains (it always does, over device memory), the plan's layout
replaces the user's (the "user" strategy plans the user's, auto may not:
``Plan.constraints`` says which are followed), so the program runs what was priced.

Before/after, for a pinned ``dot_general`` whose lhs arrives split on the wrong dim::

    c = dot_general a b                      a' = sharding_constraint[S(data)xR] a
                                             c  = dot_general a' b
                                             c' = sharding_constraint[S(data)xS(model)] c
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Sequence

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from autopar.plan import Pin
from autopar.sharding import to_spec
from autopar.substitute import DEAD, KernelTable, Pending
from ir import offload as ir_offload
from ir import recompute, replay
from ir.params import constraint_spec

_INLINE = ("jit", "pjit", "closed_call", "core_call")
# primitive -> params holding the sub-jaxprs to retrace (a tuple param holds several regions).
_RETRACE = {
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "scan": ("jaxpr",),
    "while": ("body_jaxpr", "cond_jaxpr"),
    "cond": ("branches",),
}
# Primitives whose sub-jaxpr the tracer inlined (no region index in the path) rather than kept as
# a region (a region index follows the equation index).
_INLINED_CALLS = ("remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call",
                  "custom_vjp_call_jaxpr")


class PinTable:
    """Pins by (path, slot, index), plus the paths that hold pins strictly below them; with a
    plan's kernels (``autopar.substitute``), the run of the trace in progress as ``kernels``;
    ``moved``: the operands the trace in progress has moved along an ``in`` chain so far."""

    def __init__(self, pins: Iterable[Pin], mesh):
        self.mesh = mesh
        self.kernels = None
        self.moved: dict[tuple, tuple] = {}    # (id(value), chain) -> (value, moved value)
        self.chains: dict[tuple, tuple[NamedSharding, ...]] = {}
        self.inner: set[tuple[int, ...]] = set()
        # top-level equation path -> the variables its operand waits for (``ir.offload.holds``)
        self.holds: dict[tuple[int, ...], tuple] = {}
        for p in pins:
            self.chains[(p.path, p.slot, p.index)] = tuple(
                NamedSharding(mesh, to_spec(s)) for s in p.chain)
            for n in range(len(p.path)):
                self.inner.add(p.path[:n])

    def constrain(self, x, path: tuple[int, ...], slot: str, index: int):
        """``x`` through the layouts of the pin at (path, slot, index); an ``in`` chain that
        already moved ``x`` in this trace gives the value it made (one move for all readers)."""
        chain = self.chains.get((path, slot, index), ())
        if x is DEAD or isinstance(x, Pending) or not chain:
            return x
        key = (id(x), chain) if slot == "in" else None
        hit = self.moved.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        y = x
        for sharding in chain:
            y = jax.lax.with_sharding_constraint(y, sharding)
        if key is not None:
            self.moved[key] = (x, y)   # holds x: its id is not reused while the entry lives
        return y

    @contextlib.contextmanager
    def trace(self):
        """A new trace (the step, a retraced body): its moves are its own, since a value moved
        in one trace cannot be read in another."""
        outer, self.moved = self.moved, {}
        try:
            yield
        finally:
            self.moved = outer


_read, _bind, _user_context = replay.read, replay.bind, replay.user_context


def eval_pinned(jaxpr, consts: Sequence, args: Sequence, table: PinTable, path=()) -> list:
    """Evaluate ``jaxpr`` like ``jax.core.eval_jaxpr``, enforcing the pins under ``path``."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        with _user_context(eqn):
            if table.kernels is not None and table.kernels.visit(here, eqn, env, _read):
                continue   # replaced by a kernel, or dead
            invals = [table.constrain(_read(env, v), here, "in", k)
                      for k, v in enumerate(eqn.invars)]
            if here in table.holds:    # an offloaded group's move waits for the one before it
                deps = [_read(env, v) for v in table.holds[here]]
                invals[0] = jax.lax.optimization_barrier((invals[0], deps))[0]
            outs = _eval_eqn(eqn, invals, table, here)
            for k, (v, x) in enumerate(zip(eqn.outvars, outs)):
                env[v] = table.constrain(x, here, "out", k)
            if table.kernels is not None:
                table.kernels.after(here, [env[v] for v in eqn.outvars])
    return [_read(env, v) for v in jaxpr.outvars]


def _eval_eqn(eqn, invals, table: PinTable, here: tuple[int, ...]) -> list:
    prim = eqn.primitive.name
    if prim == "sharding_constraint" and (here, "out", 0) in table.chains and constraint_spec(
            eqn.params, len(eqn.invars[0].aval.shape)) is not None:
        return list(invals)     # the user's own constraint: the plan's pin on it decides
    if here in table.inner and prim in _INLINE and "jaxpr" in eqn.params:
        inner = eqn.params["jaxpr"]
        return eval_pinned(inner.jaxpr, inner.consts, invals, table, here)
    if here in table.inner and prim in _RETRACE:
        params = dict(eqn.params)
        for r, key in enumerate(_RETRACE[prim]):
            params[key] = _retrace_param(eqn.params[key], table, here, prim, r)
        outs = _bind(eqn, invals, params)
    elif here in table.inner and prim == "custom_linear_solve":   # the tracer inlined `solve`
        jaxprs = eqn.params["jaxprs"]
        params = dict(eqn.params, jaxprs=jaxprs._replace(
            solve=_retrace(jaxprs.solve, table, here)))
        outs = _bind(eqn, invals, params)
    else:
        outs = _bind(eqn, invals)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _retrace_param(sub, table: PinTable, here: tuple[int, ...], prim: str, r: int):
    """The sub-jaxpr(s) of one parameter, retraced with their pins (a branches tuple gives one
    region per branch)."""
    if prim in _INLINED_CALLS:
        return _retrace(sub, table, here)
    if isinstance(sub, (tuple, list)):   # cond branches: regions 0..n-1
        return tuple(_retrace(b, table, here + (k,)) for k, b in enumerate(sub))
    return _retrace(sub, table, here + (r,))


def _retrace(sub, table: PinTable, path: tuple[int, ...]):
    """``sub`` (a ClosedJaxpr or an open Jaxpr) evaluated under its pins and traced again into
    the same kind of jaxpr, with the same input and output types."""
    closed = isinstance(sub, jcore.ClosedJaxpr)
    jaxpr = sub.jaxpr if closed else sub
    consts = sub.consts if closed else ()

    def body(*args):
        with table.trace():
            args = [table.constrain(a, path, "arg", k) for k, a in enumerate(args)]
            outs = eval_pinned(jaxpr, consts, args, table, path)
            return [table.constrain(o, path, "res", k) for k, o in enumerate(outs)]

    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                  weak_type=getattr(v.aval, "weak_type", False))
             for v in jaxpr.invars]
    new = jax.make_jaxpr(body)(*specs)
    if closed:
        return new
    if new.consts:   # an open jaxpr cannot carry constants: keep the original body unpinned
        warnings.warn(f"autopar: the body at {path} could not be retraced without constants; "
                      f"XLA chooses its layouts", RuntimeWarning, stacklevel=2)
        return sub
    return new.jaxpr


def build(graph, plan, mesh, donate_argnums=()):
    """The jitted, sharded executable of ``graph``'s function under ``plan`` on ``mesh``
    (its loops rewritten first where the plan recomputes their saved values)."""
    if plan.recompute:
        graph = recompute.rewrite_graph(graph, {r.site: r.policy for r in plan.recompute})
    on_host_in, on_host_out = set(), set()
    if plan.offload:     # the state it holds in host memory, streamed through the device
        from autopar.planner import offload

        on_host_in = {k for o in plan.offload for k in o.inputs}
        on_host_out = {j for o in plan.offload for j in o.outputs}
        graph = offload.rewrite_graph(graph, sorted(on_host_in))
    warn_host_callbacks(graph, mesh)
    table = PinTable(plan.pins, mesh)
    if plan.offload:
        table.holds = {(i,): deps for i, deps in ir_offload.holds(graph.jaxpr).items()}
    kernels = KernelTable(graph, plan, mesh) if plan.kernels else None
    if kernels is not None:
        table.inner |= kernels.prefixes   # enter the jit calls that hold replaced equations
    closed = graph.jaxpr
    in_shardings = jax.tree_util.tree_unflatten(graph.in_tree, [
        _named(mesh, s, k in on_host_in) for k, s in enumerate(plan.input_shardings)])
    out_shardings = jax.tree_util.tree_unflatten(graph.out_tree, [
        _named(mesh, s, j in on_host_out) for j, s in enumerate(plan.output_shardings)])

    def step(*args):
        flat = jax.tree_util.tree_leaves(args)
        table.kernels = kernels.start(table) if kernels is not None else None   # per trace
        if table.kernels is not None:
            table.kernels.inputs(flat, closed.consts)
        with table.trace():
            outs = eval_pinned(closed.jaxpr, closed.consts, flat, table)
        if table.kernels is not None:
            outs = table.kernels.results_of(outs)
        return jax.tree_util.tree_unflatten(graph.out_tree, outs)

    # in_tree is the tree of the argument tuple: jit wants one entry per positional argument.
    return jax.jit(step, in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                   donate_argnums=donate_argnums), in_shardings


def _named(mesh, s, on_host: bool) -> NamedSharding:
    named = NamedSharding(mesh, to_spec(s))
    return named.with_memory_kind(ir_offload.HOST_MEMORY) if on_host else named


# Host callbacks that run Python while the step's other devices wait (jax.debug.print's
# debug_callback is left out: it prints and returns at once).
_CALLBACKS = ("pure_callback", "io_callback")


def warn_host_callbacks(graph, mesh) -> None:
    """A host callback in a step sharded over several CPU devices runs on one device's thread
    while the others wait for it in their next collective; XLA:CPU aborts a collective whose
    participants do not all arrive within its rendezvous timeout (40 s), as it does under plain
    ``jax.jit``. Say so before the step runs, naming the callbacks."""
    devices = getattr(mesh, "devices", None)
    if devices is None or devices.size < 2 or devices.flat[0].platform != "cpu":
        return
    found = [f"{op.prim} at {op.source or '?'}" for op in graph.all_ops() if op.prim in _CALLBACKS]
    if found:
        warnings.warn(
            f"autopar: the step calls host callbacks ({', '.join(found[:3])}) and runs sharded "
            f"over {devices.size} CPU devices: while a callback runs, the other devices wait "
            f"in their next collective, and XLA:CPU aborts the process if they wait 40 s (as "
            f"under jax.jit). Keep callbacks fast and free of jax calls, or move them out of "
            f"the step", RuntimeWarning, stacklevel=5)
