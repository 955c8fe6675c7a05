"""The public entry points: ``autopar.plan`` and ``@autopar.autoparallel``.

    trace (ir) -> build problem (rules + cost_models) -> ILP -> Plan -> codegen (jax.jit)
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

import cost_models
import ir
from autopar import codegen
from autopar.errors import AutoparError, ShardingError
from autopar.mesh import axis_sizes, concrete_mesh, default_hardware
from autopar.options import PlannerOptions, checks_enabled
from autopar.plan import Plan
from autopar.planner import make_plan


def _trace(fn: Callable, args, kwargs, donate_argnums) -> tuple[ir.Graph, float]:
    if kwargs:
        raise AutoparError(f"keyword arguments {sorted(kwargs)} are not supported by autopar yet; "
                           f"pass them positionally or close over them with functools.partial")
    t0 = time.perf_counter()
    graph = ir.trace(fn, *args, donate_argnums=donate_argnums)
    return graph, time.perf_counter() - t0


def _hardware(hardware, mesh) -> cost_models.Hardware:
    return cost_models.hardware(hardware if hardware is not None else default_hardware(mesh))


def _resolve_strategy(strategy) -> tuple[str, Any]:
    if strategy in (None, "auto"):
        return "auto", None
    if isinstance(strategy, str):
        from autopar import strategies

        return strategy, strategies.get(strategy)
    return getattr(strategy, "name", type(strategy).__name__), strategy


def plan_graph(graph: ir.Graph, mesh, *, hardware=None, memory_budget=None, strategy="auto",
               time_limit_s: float = 30.0, trace_s: float = 0.0) -> Plan:
    """Plan an already traced graph (see ``plan``)."""
    sizes = axis_sizes(mesh)
    hw = _hardware(hardware, mesh)
    cm = cost_models.CostModel(hw, sizes)
    name, strat = _resolve_strategy(strategy)
    if hasattr(strat, "bind"):   # hand-written: find parameters and their roles in this graph
        strat = strat.bind(graph, sizes)
    fixed = strat.fix_inputs(graph, sizes) if strat is not None else None
    op_filter = getattr(strat, "allows", None)
    budget = hw.memory_bytes if memory_budget is None else float(memory_budget)
    starts = _handwritten_starts() if strat is None else ()
    if checks_enabled():
        ir.verify(graph)
    opts = PlannerOptions(strategy=name, memory_budget=budget, time_limit_s=time_limit_s,
                          fixed_inputs=fixed, op_filter=op_filter, starts=tuple(starts))
    notes = tuple(getattr(strat, "notes", ()))
    if notes:
        warnings.warn(f"autopar: strategy {name!r} cannot place every parameter as it intends "
                      f"(plan.summary() lists them):\n  " + "\n  ".join(notes), UserWarning,
                      stacklevel=3)
    plan = make_plan(graph, sizes, cm, opts, trace_s=trace_s)
    return dataclasses.replace(plan, notes=notes) if notes else plan


# Hand-written strategies the auto plan starts from: the cheapest one that fits seeds the ILP.
# One that a mesh cannot take is skipped where its layouts are made (planner._best_start).
_STARTS = ("dp", "zero2", "zero3", "megatron", "fsdp_tp")


def _handwritten_starts() -> list:
    from autopar import strategies

    return [strategies.get(name) for name in _STARTS]


def plan(fn: Callable, *args, mesh, hardware=None, memory_budget: float | None = None,
         strategy="auto", donate_argnums=(), time_limit_s: float = 30.0, **kwargs) -> Plan:
    """Plan ``fn(*args)`` for ``mesh`` without running it.

    Args:
      fn: a training step (any JAX-traceable function of pytrees of arrays).
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct``s (a 175B model costs no memory).
      mesh: a ``jax.sharding.Mesh``, an ``AbstractMesh`` or a dict of axis sizes
        (``{"data": 32, "model": 8}``) — the devices need not be present.
      hardware: a profile name (``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``) or a
        ``cost_models.Hardware``; default: the mesh's devices, else ``"h100"``.
      memory_budget: per-device bytes the plan must fit; default the hardware's memory.
      strategy: ``"auto"`` (the ILP chooses) or a hand-written strategy name / object.
      time_limit_s: the solver's (deterministic) time limit; the best plan found is returned.

    Returns:
      An ``autopar.Plan``.
    """
    graph, trace_s = _trace(fn, args, kwargs, donate_argnums)
    return plan_graph(graph, mesh, hardware=hardware, memory_budget=memory_budget,
                      strategy=strategy, time_limit_s=time_limit_s, trace_s=trace_s)


def _signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))


class AutoParallel:
    """A training step that plans, compiles and runs itself sharded (``@autopar.autoparallel``)."""

    def __init__(self, fn: Callable, *, mesh, hardware=None, memory_budget=None,
                 strategy="auto", donate_argnums=(), time_limit_s: float = 30.0,
                 plan: Plan | None = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.mesh = concrete_mesh(mesh)
        self.options = dict(hardware=hardware, memory_budget=memory_budget, strategy=strategy,
                            time_limit_s=time_limit_s)
        self.donate_argnums = tuple(donate_argnums) if not isinstance(donate_argnums, int) else (
            donate_argnums,)
        self._given_plan = plan
        self._cache: dict[tuple, tuple[Plan, Any, Any, ir.Graph]] = {}
        self._executables: dict[tuple, Any] = {}
        self._last: Plan | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan of the last signature this step was called or lowered with."""
        return self._last

    def _compiled(self, args, key=None):
        key = _signature(args) if key is None else key
        hit = self._cache.get(key)
        if hit is None:
            graph, trace_s = _trace(self.fn, args, {}, self.donate_argnums)
            plan = self._plan_for(graph, trace_s)
            jitted, in_shardings = codegen.build(graph, plan, self.mesh, self.donate_argnums)
            hit = (plan, jitted, in_shardings, graph)
            self._cache[key] = hit
        self._last = hit[0]
        return hit

    def _plan_for(self, graph: ir.Graph, trace_s: float) -> Plan:
        given = self._given_plan
        if given is not None:
            if given.graph_fingerprint != graph.fingerprint():
                raise ShardingError(
                    f"the loaded plan was made for another function or signature (graph "
                    f"{given.graph_fingerprint}, this call traces to {graph.fingerprint()}); "
                    f"plan again, or call with the arguments the plan was made for")
            if dict(given.mesh) != axis_sizes(self.mesh):
                raise ShardingError(f"the loaded plan is for mesh {dict(given.mesh)}, this step "
                                    f"runs on {axis_sizes(self.mesh)}; plan again for this mesh")
            return given.with_trees(graph.in_tree, graph.out_tree)
        return plan_graph(graph, self.mesh, trace_s=trace_s, **self.options)

    def __call__(self, *args):
        key = _signature(args)   # placing arrays changes no shape or dtype: one key serves both
        plan, jitted, in_shardings, graph = self._compiled(args, key)
        args = jax.tree_util.tree_map(_place, args, in_shardings)
        exe = self._executables.get(key)
        if exe is None:
            exe = self._executables[key] = self._compile(plan, jitted, args, graph)
        return exe(*args)

    def _compile(self, plan: Plan, jitted, args, graph: ir.Graph):
        """Compile once per signature. Should XLA reject the constraints the plan pins inside the
        step (its partitioner has failed verification on some layouts), fall back to the plan's
        input and output layouts alone, and say so."""
        try:
            return jitted.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - XLA raises several runtime error types
            if not plan.pins:
                raise
            warnings.warn(f"autopar: XLA could not compile the plan's {len(plan.pins)} inner "
                          f"sharding constraints ({type(e).__name__}: {str(e)[:200]}); running "
                          f"with the plan's input/output layouts only, XLA chooses the rest",
                          RuntimeWarning, stacklevel=3)
            unpinned = dataclasses.replace(plan, pins=())
            jitted, _ = codegen.build(graph, unpinned, self.mesh, self.donate_argnums)
            return jitted.lower(*args).compile()

    def lower(self, *args):
        """Like ``jax.jit(...).lower``: arguments may be ShapeDtypeStructs."""
        _, jitted, _, _ = self._compiled(args)
        return jitted.lower(*args)


def _place(x, sharding):
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.device_put(x, sharding)


def autoparallel(fn: Callable | None = None, *, mesh, hardware=None,
                 memory_budget: float | None = None, strategy="auto", donate_argnums=(),
                 time_limit_s: float = 30.0, plan: Plan | None = None):
    """Decorate a training step so it runs sharded over ``mesh`` by a plan autopar chooses.

    ``autoparallel(fn, mesh=...)`` and ``@autoparallel(mesh=...)`` both work. The first call with
    a new abstract signature traces, plans and compiles; later calls reuse the executable.
    ``plan=`` applies a saved plan (``Plan.from_json``) without solving.
    """
    def wrap(f):
        return AutoParallel(f, mesh=mesh, hardware=hardware, memory_budget=memory_budget,
                            strategy=strategy, donate_argnums=donate_argnums,
                            time_limit_s=time_limit_s, plan=plan)

    return wrap(fn) if fn is not None else wrap
