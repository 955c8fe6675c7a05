"""What users hand to autopar, checked once where it comes in.

``autopar.plan``, ``autopar.autoparallel``, ``plan_graph`` and each call of a decorated step run
these checks before anything reaches the tracer, the solver or XLA; every failure is an
``AutoparError`` saying what was given, where (option, argument path, shape, mesh axis) and how to
fix it. Deeper layers may then assume well-formed values: a failure there is a bug, not a user
error, and surfaces as such.
"""
from __future__ import annotations

import difflib
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from autopar.errors import AutoparError, PlanError, ShardingError
from autopar.sharding import layout_for

# Budgets beyond this many bytes cannot bind on any device; the ILP works in KiB and int64.
MAX_BUDGET_BYTES = 2.0**60
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


# ---- options ----------------------------------------------------------------------------------
def reject_unknown(kwargs: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Name an unknown keyword option and its closest known one."""
    if not kwargs:
        return
    name = sorted(kwargs)[0]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}=? " if close else ""
    raise AutoparError(
        f"{where}() got an unknown option {name}={kwargs[name]!r}; {hint}{where} takes "
        f"{', '.join(known)}. Keyword arguments of the step itself are not supported: pass them "
        f"positionally or bind them with functools.partial.")


def memory_budget(value: Any) -> float | None:
    """Per-device bytes as a float; ``None`` for ``None`` (the caller's default applies) and for
    infinity (no limit)."""
    if value is None:
        return None
    if isinstance(value, str):
        raise AutoparError(f"memory_budget={value!r} is a string; give bytes per device as a "
                           f"number, {_size_hint(value)}")
    x = _real("memory_budget", value, "bytes per device, e.g. 16e9 or 16 * 2**30")
    if x == math.inf:
        return None
    if x <= 0:
        raise AutoparError(f"memory_budget={value!r} must be > 0 bytes per device (None for no "
                           f"limit), e.g. memory_budget=16e9")
    if x > MAX_BUDGET_BYTES:
        raise AutoparError(f"memory_budget={value!r} bytes exceeds any device "
                           f"({MAX_BUDGET_BYTES:.3g} bytes); pass None for no limit")
    return x


def time_limit(value: Any) -> float:
    """Seconds, > 0 (infinity allowed: no limit)."""
    x = _real("time_limit_s", value, "seconds, e.g. time_limit_s=10")
    if x <= 0:
        raise AutoparError(f"time_limit_s={value!r} must be > 0 seconds, e.g. time_limit_s=10")
    return x


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise AutoparError(f"{name}={value!r} must be True or False")
    return value


def tune(value: Any, strategy: Any, plan: Any) -> float | bool | None:
    """``tune=``: None when off (False); True: the hardware's band (``autopar.tune.band``,
    resolved where the hardware is known); else the fraction of auto's predicted step within
    which other plans are timed. Only auto has runners-up to time."""
    if value is False or value is None:
        return None
    if value is True:
        within = True
    else:
        within = _real("tune", value, "True, or the fraction of auto's predicted step within "
                                      "which to time other plans, e.g. tune=0.1")
        if not 0 < within <= 10:
            raise AutoparError(f"tune={value!r}: give True, or a fraction of auto's predicted "
                               f"step in (0, 10], e.g. tune=0.1 (plans predicted within 10%)")
    if plan is not None:
        raise AutoparError("tune= chooses among plans by timing them, plan= applies a saved one "
                           "without planning: drop one of them")
    if strategy not in (None, "auto"):
        raise AutoparError(f"tune= times auto's plan against the runners-up the cost model cannot "
                           f"tell apart from it; with strategy={short(strategy)} there is one "
                           f"plan to run: drop tune= or strategy=")
    return within


KERNEL_MODES = ("auto", "always", "never")


def kernels(value: Any, hw=None, mesh=None) -> str:
    """``kernels=``: "auto", "always" or "never". Given the hardware profile and the mesh,
    "auto" resolves to "auto" (the ILP weighs each kernel against XLA's ops) on a GPU profile,
    and to "never" for a CPU profile or a mesh of CPU devices: there Pallas kernels run only in
    its interpreter, far slower than XLA's code."""
    if not isinstance(value, str) or value not in KERNEL_MODES:
        raise AutoparError(f"kernels={value!r} must be one of {KERNEL_MODES}: 'auto' lets the "
                           f"planner choose fused kernels where its cost model says so (on GPU "
                           f"profiles), 'always' uses one wherever the layouts allow, 'never' "
                           f"none")
    if value != "auto" or hw is None:
        return value
    devices = getattr(mesh, "devices", None)
    on_cpu = devices is not None and getattr(devices.flat[0], "platform", "") == "cpu"
    return "never" if on_cpu or hw.name.lower().startswith("cpu") else "auto"


MEMORY_DECISIONS = ("recompute", "offload")


def memory_decisions(value: Any) -> tuple[str, ...]:
    """``memory_decisions=``: which trades the planner may make where no layout fits the
    budget, a subset of ``MEMORY_DECISIONS`` (``()``: none, the budget error at once)."""
    items = (value,) if isinstance(value, str) else value
    try:
        names = tuple(items)
    except TypeError:
        names = None
    if names is None or any(n not in MEMORY_DECISIONS for n in names):
        raise AutoparError(f"memory_decisions={short(value)} must be a tuple of names from "
                           f"{MEMORY_DECISIONS} (the backward pass recomputing saved values, the "
                           f"optimizer's state held in host memory); pass () to allow neither")
    return tuple(n for n in MEMORY_DECISIONS if n in names)


def donate_argnums(value: Any) -> tuple[int, ...]:
    """A sorted tuple of distinct non-negative positions."""
    items = (value,) if isinstance(value, numbers.Integral) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (value,)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
            raise AutoparError(f"donate_argnums={value!r}: each entry must be the position (an "
                               f"int >= 0) of an argument whose buffers the step may reuse, "
                               f"e.g. donate_argnums=(0,)")
    return tuple(sorted({int(i) for i in items}))


def check_donation_in_range(donated: Sequence[int], nargs: int) -> None:
    bad = [i for i in donated if i >= nargs]
    if bad:
        raise AutoparError(f"donate_argnums={tuple(donated)} names argument {bad[0]}, but the "
                           f"step was called with {nargs} positional arguments; donate "
                           f"positions 0..{nargs - 1}")


def strategy(value: Any):
    """``(name, strategy object or None for auto)``."""
    if value is None or value == "auto":
        return "auto", None
    if value == "user":          # the arguments' committed layouts, read where they are known
        from autopar.strategies.user import FROM_ARGUMENTS

        return "user", FROM_ARGUMENTS
    if isinstance(value, str):
        from autopar import strategies

        return value, strategies.get(value)
    if not callable(getattr(value, "fix_inputs", None)):
        raise ShardingError(
            f"strategy={value!r} ({type(value).__name__}) is not a strategy: pass 'auto', a name "
            f"from autopar.strategies.NAMES, autopar.strategies.get(name, ...), or an object with "
            f"fix_inputs(graph, mesh) -> {{input index: layout}}")
    allows = getattr(value, "allows", None)
    if allows is not None and not callable(allows):
        raise ShardingError(f"strategy {value!r}: its allows attribute must be callable "
                            f"allows(op, strategy[, origins]) -> bool, or absent")
    return getattr(value, "name", type(value).__name__), value


def strategy_list(value: Any, where: str) -> tuple:
    """A non-empty sequence of strategies (names or objects; each is planned, or reported as an
    error row, by ``compare`` itself)."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise AutoparError(f"{where}(strategies={short(value)}): give a list of strategies, e.g. "
                           f"strategies=('dp', 'zero3', 'auto')")
    if not value:
        raise AutoparError(f"{where}(strategies=()): there is nothing to compare; give at least "
                           f"one strategy, e.g. strategies=('dp', 'auto'), or leave the default")
    return tuple(value)


def fixed_layouts(fixed: Any, graph, mesh: Mapping[str, int], name: str) -> dict[int, tuple]:
    """A strategy's ``fix_inputs`` answer: input index -> a layout that fits that input."""
    if not isinstance(fixed, Mapping):
        raise ShardingError(f"strategy {name!r}: fix_inputs returned {type(fixed).__name__}; it "
                            f"must return a dict {{input index: layout}}")
    out = {}
    for k, layout in fixed.items():
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not (
                0 <= k < len(graph.inputs)):
            raise ShardingError(f"strategy {name!r}: fix_inputs names input {k!r}, but the step "
                                f"has inputs 0..{len(graph.inputs) - 1}")
        shape = graph.values[graph.inputs[k]].shape
        where = f"strategy {name!r}, input {graph.input_paths[k]} of shape {shape}"
        out[int(k)] = layout_for(layout, shape, mesh, where)
    return out


# ---- arguments --------------------------------------------------------------------------------
def leaf_types(args: tuple, *, run: bool) -> list:
    """The abstract type (``jax.typeof``) of every leaf of ``args``, checked.

    Python scalars are accepted as the weak-typed scalars jax makes of them. With ``run`` the
    leaves must be values (not ``ShapeDtypeStruct``s), and arrays must still hold their buffers
    (a donated array is deleted by the call it was donated to).
    """
    out, deleted = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        where = "argument " + jax.tree_util.keystr(path)
        if isinstance(x, jax.core.Tracer):
            raise AutoparError(
                f"{where} is a jax tracer ({x.aval}): the autoparallel step was called inside "
                f"jax.jit/grad/vmap. It compiles and runs on its own mesh: call it outside "
                f"those transforms, or transform the function first, e.g. "
                f"autoparallel(jax.grad(loss), mesh=...)")
        if run and isinstance(x, jax.ShapeDtypeStruct):
            raise AutoparError(f"{where} is a ShapeDtypeStruct {x.dtype}{list(x.shape)}: running "
                               f"needs arrays; use step.lower(...) or autopar.plan(...) to plan "
                               f"from shapes alone")
        if run and isinstance(x, jax.Array) and x.is_deleted():
            deleted.append(f"{jax.tree_util.keystr(path)} ({x.dtype}{list(x.shape)})")
        out.append(_typeof(x, where))
    if deleted:
        what = (f"argument {deleted[0]} was deleted" if len(deleted) == 1 else
                f"{len(deleted)} argument arrays were deleted (the first: argument {deleted[0]})")
        raise AutoparError(
            f"{what}: donated to an earlier call (donate_argnums), whose outputs reuse the "
            f"buffers, or freed with .delete(). Pass the value that call returned instead, e.g. "
            f"state, loss = step(state, batch)")
    return out


def _typeof(x: Any, where: str):
    try:
        return jax.typeof(x)
    except OverflowError as e:
        raise AutoparError(f"{where} = {x!r}: {e}; pass a jnp.int64 array with "
                           f"jax_enable_x64, or a value that fits") from None
    except TypeError:
        raise AutoparError(
            f"{where} is {type(x).__name__} {short(x)}, which jax cannot trace. autopar traces "
            f"arrays of numeric dtypes (jax or numpy) and jax.ShapeDtypeStructs, and keeps every "
            f"other leaf static, as eqx.filter_jit does: convert it to a numeric array, or "
            f"filter it out of the arguments (params, static = eqx.partition(tree, "
            f"eqx.is_array)) and close over it with functools.partial") from None


def abstract(args: tuple, types: list) -> tuple:
    """``args`` as unsharded ``ShapeDtypeStruct``s: tracing needs no data and no mesh."""
    tree = jax.tree_util.tree_structure(args)
    leaves = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=getattr(t, "weak_type", False))
              for t in types]
    return jax.tree_util.tree_unflatten(tree, leaves)


def signature(args: tuple, types: list) -> tuple:
    """The cache key of a call: tree, shapes, dtypes and weak types, as ``jax.jit`` keys it."""
    return (jax.tree_util.tree_structure(args),
            tuple((tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False)))
                  for t in types))


def signature_difference(want: tuple, got: tuple, args: tuple) -> str:
    """Where two ``signature``s differ, for a message; ``args`` are those of ``got``."""
    if want[0] != got[0]:
        return f"the argument trees differ (compiled for {want[0]}, called with {got[0]})"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    for path, a, b in zip(paths, want[1], got[1]):
        if a != b:
            return (f"argument {path} was {a[1]}{list(a[0])}, is now {b[1]}{list(b[0])}"
                    f"{' (weak-typed)' if b[2] else ''}")
    return "the static leaves or NNX graph structure differ"


def callable_fn(fn: Any, where: str) -> Callable:
    if not callable(fn):
        raise AutoparError(f"{where} needs the step function first; got {type(fn).__name__} "
                           f"{short(fn)}, which is not callable")
    return fn


# ---- helpers ----------------------------------------------------------------------------------
def _real(name: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AutoparError(f"{name}={value!r} ({type(value).__name__}) must be a number: {what}")
    x = float(value)
    if math.isnan(x):
        raise AutoparError(f"{name}={value!r} is NaN; give {what}")
    return x


def _size_hint(text: str) -> str:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m and m.group(2).lower() in _UNITS:
        try:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            return f"e.g. memory_budget={n:.6g} for {text.strip()}".replace("e+0", "e").replace(
                "e+", "e")
        except ValueError:
            pass
    return "e.g. memory_budget=16e9 (16 GB) or 16 * 2**30 (16 GiB)"


def short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- saved plans ------------------------------------------------------------------------------
def _recomputed(plan, graph):
    from ir import recompute

    sites = recompute.sites_of(graph)
    for r in plan.recompute:
        if r.site >= len(sites):
            raise PlanError(f"the loaded plan recomputes at loop {r.site} ({r.where}), but this "
                            f"step has {len(sites)} loop(s) whose saved values can be "
                            f"recomputed; plan again for this step")
    return recompute.rewrite_graph(graph, {r.site: r.policy for r in plan.recompute})


def plan_applies(plan, graph) -> None:
    """A loaded plan fits the traced ``graph``: same program (fingerprint), and each pinned
    layout names an op of this program and divides its output shape."""
    inputs = _input_difference(plan, graph)    # before the fingerprint, which may be edited
    if inputs is not None or plan.graph_fingerprint != graph.fingerprint():
        from autopar.planner import constraints

        here = constraints.count(graph)
        context = ("" if inputs is not None or bool(here) == bool(plan.constraints) else
                   f" (the plan was made for a step with {len(plan.constraints)} sharding "
                   f"constraint(s), this one has {here}: flax's nn.with_logical_constraint makes "
                   f"them only under a mesh, so plan and run the step both inside "
                   f"jax.set_mesh(mesh), or both outside)")
        raise PlanError(f"the loaded plan was made for another program: {_difference(plan, graph)}"
                        f"{context}; plan again for this step, or call it with the arguments the "
                        f"plan was made for")
    if plan.recompute:        # its ops are those of the step its recomputation rewrites
        graph = _recomputed(plan, graph)
    if plan.offload:          # ... and its offload (``ir.offload``) streams
        from autopar.planner import offload

        graph = offload.rewrite_graph(graph, [k for o in plan.offload for k in o.inputs])
    _check_choices(plan, graph)
    mesh = dict(plan.mesh)
    by_origin = {tuple(op.origin): op for op in graph.all_ops()}
    for pin in plan.pins:
        v, op = _pinned_value(pin, by_origin)
        if v is None:
            raise PlanError(f"the loaded plan pins {pin.slot} {pin.index} of equation "
                            f"{tuple(pin.path)}, which this step does not have; the plan file "
                            f"was edited: plan again")
        for s in pin.chain:
            layout_for(s, graph.values[v].shape, mesh,
                       f"plan pin on op {op.id} {op.prim} @ {op.source or '?'}", PlanError)
    for j, (s, v) in enumerate(zip(plan.output_shardings, graph.outputs)):
        layout_for(s, graph.values[v].shape, mesh, f"plan output {graph.output_paths[j]}",
                   PlanError)


def _pinned_value(pin, by_origin):
    """(value id, op) a pin addresses, or (None, None) when the graph has no such place."""
    if pin.slot in ("out", "in"):
        op = by_origin.get(tuple(pin.path))
        vals = () if op is None else (op.outs if pin.slot == "out" else op.ins)
    else:   # a region's parameter or result: the path ends with the region's index
        op = by_origin.get(tuple(pin.path[:-1])) if pin.path else None
        r = pin.path[-1] if pin.path else -1
        region = op.regions[r] if op is not None and 0 <= r < len(op.regions) else None
        vals = () if region is None else (region.inputs if pin.slot == "arg" else region.outputs)
    return (vals[pin.index], op) if 0 <= pin.index < len(vals) else (None, None)


def _difference(plan, graph) -> str:
    """Where a plan and a graph first differ, for the mismatch message."""
    return _input_difference(plan, graph) or (
        "the input paths and shapes match but the traced program differs (dtypes, ops, or "
        "op parameters such as a reduction axis or a constant)")


def _input_difference(plan, graph) -> str | None:
    """The first input whose path or shape differs between a plan and a graph, or None."""
    shapes = tuple(graph.values[v].shape for v in graph.inputs)
    if len(plan.input_paths) != len(graph.inputs):
        return (f"it has {len(plan.input_paths)} inputs, this call has {len(graph.inputs)} "
                f"(e.g. {list(graph.input_paths[:3])})")
    for p, q, a, b in zip(plan.input_paths, graph.input_paths, plan.input_shapes, shapes):
        if p != q or tuple(a) != tuple(b):
            return f"its input {p} has shape {tuple(a)}, this call's {q} has shape {tuple(b)}"
    return None


def _check_choices(plan, graph) -> None:
    """Each op a plan decides for is an op of ``graph`` with the same primitive: a plan whose
    fingerprint was copied from another program's still names that program's ops."""
    prims = {op.id: op.prim for op in graph.all_ops()}
    for op_id, prim, source, _ in plan.choices:
        if prims.get(op_id) != prim:
            have = f"op {op_id} is {prims[op_id]}" if op_id in prims else f"there is no op {op_id}"
            raise PlanError(f"the loaded plan decides op {op_id} {prim} @ {source or '?'}, but in "
                            f"this step {have}: the plan was made for another program (its "
                            f"fingerprint was edited); plan again for this step")


# ---- where a plan is applied: its mesh and its inputs --------------------------------------------
def mesh_difference(plan_mesh, mesh) -> str | None:
    """How the mesh a plan was made for differs from ``mesh`` (names, sizes or order of the
    axes), or None when they are the same. A plan's layouts name axes, and its predictions price
    each axis by its place in the device order, so the order counts too."""
    from autopar.mesh import axis_sizes

    want, have = list(dict(plan_mesh).items()), list(axis_sizes(mesh).items())
    if want == have:
        return None
    if dict(want) == dict(have):
        return (f"the axis order differs: the plan's mesh is {_axes(want)}, this one "
                f"{_axes(have)}")
    if sorted(n for n, _ in want) != sorted(n for n, _ in have):
        return f"the axis names differ: the plan's mesh is {_axes(want)}, this one {_axes(have)}"
    sizes = [f"{n!r} {a} -> {dict(have)[n]}" for n, a in want if dict(have)[n] != a]
    return (f"the axis sizes differ ({', '.join(sizes)}): the plan's mesh is {_axes(want)}, "
            f"this one {_axes(have)}")


def _axes(pairs) -> str:
    return "(" + ", ".join(f"{n}={s}" for n, s in pairs) + ")"


def check_plan_mesh(plan, mesh, where: str = "the given plan") -> None:
    """Refuse a plan made for another mesh, saying what differs."""
    diff = mesh_difference(plan.mesh, mesh)
    if diff is not None:
        raise PlanError(f"{where} was made for another mesh: {diff}; plan again for this mesh "
                        f"(drop plan=), or run on the mesh the plan was made for")


def state_difference(plan, leaves: Sequence[tuple[str, tuple]], argnum: int) -> str | None:
    """How argument ``argnum`` of ``plan`` differs from ``leaves`` ((keystr path, shape) of a
    state, in flattened order), or None when the plan's inputs there are those leaves."""
    prefix = f"[{argnum}]"
    mine = [(p[len(prefix):], tuple(s)) for p, s in zip(plan.input_paths, plan.input_shapes)
            if p.startswith(prefix)]
    if not mine:
        return f"it has no argument {argnum} (its inputs: {list(plan.input_paths[:3])}, ...)"
    paths = dict(mine)
    for path, shape in leaves:
        if path not in paths:
            return (f"its argument {argnum} has no leaf {path} ({len(mine)} leaves, "
                    f"{len(leaves)} in the state)")
        if tuple(paths[path]) != tuple(shape):
            return f"its input {prefix}{path} has shape {paths[path]}, the state's {tuple(shape)}"
    if len(mine) != len(leaves):
        extra = sorted(set(paths) - {p for p, _ in leaves})
        return f"its argument {argnum} has leaves the state lacks: {extra[:3]}"
    return None
