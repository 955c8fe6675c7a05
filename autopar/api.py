"""The public entry points: ``autopar.plan`` and ``@autopar.autoparallel``.

    trace (ir) -> build problem (rules + cost_models) -> ILP -> Plan -> codegen (jax.jit)
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

import cost_models
import ir
from autopar import arguments, codegen, distributed, mesh_search, strategies, validate
from autopar.errors import AutoparError, PlanError, ShardingError
from autopar.executable import Compiled, Lowered
from autopar.mesh import axis_sizes, caller_axes, concrete_mesh, on_mesh
from autopar.plan import Plan
from autopar.request import plan_graph, resolve_deterministic

PLAN_OPTIONS = ("mesh", "hardware", "memory_budget", "strategy", "donate_argnums",
                "time_limit_s", "deterministic", "pipeline", "kernels", "memory_decisions")


def _trace(fn: Callable, args, types, donate_argnums) -> tuple[ir.Graph, float]:
    """Trace from unsharded abstract arguments: no data, and no mesh the caller's arrays carry
    (the caller's context mesh only as Auto axes, for the step's own constraints)."""
    validate.check_donation_in_range(donate_argnums, len(args))
    t0 = time.perf_counter()
    with caller_axes():
        graph = ir.trace(fn, *validate.abstract(args, types), donate_argnums=donate_argnums)
    return graph, time.perf_counter() - t0


def plan(fn: Callable, *args, mesh=None, hardware=None, memory_budget: float | None = None,
         strategy="auto", donate_argnums=(), time_limit_s: float = 30.0,
         deterministic: bool | None = None, pipeline=None, kernels: str = "never",
         memory_decisions=validate.MEMORY_DECISIONS, **options) -> Plan:
    """Plan ``fn(*args)`` for ``mesh`` without running it.

    Args:
      fn: a training step (any JAX-traceable function of pytrees of arrays).
      *args: its arguments, pytrees whose arrays (or ``jax.ShapeDtypeStruct``s: a 175B model
        costs no memory) are traced. Every other leaf (a function, a Python scalar, a string)
        is static, as ``eqx.filter_jit`` keeps it: fixed in the plan and part of its cache key.
        Flax NNX objects (modules, ``nnx.Optimizer``, ``nnx.Rngs``, any ``nnx.Object``) are
        split as ``nnx.jit`` splits them: their state is traced, and a decorated step writes
        every change to it back into the caller's objects (see ``autopar.arguments``).
      mesh: a ``jax.sharding.Mesh``, an ``AbstractMesh`` or a dict of axis sizes
        (``{"data": 32, "model": 8}``) — the devices need not be present. Or a shape left to
        the planner (``autopar.mesh_search``): a device count (``mesh=64``), a list of devices,
        or a dict with open axes (``{"data": None, "model": None}``); every shape is planned
        and the fastest that fits is returned, ``Plan.mesh`` the one chosen and
        ``Plan.mesh_candidates`` the others.
      hardware: a profile name (``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``) or a
        ``cost_models.Hardware``; default: the mesh's devices, else ``"h100"``.
      memory_budget: per-device bytes the plan must fit; default the hardware's memory.
      strategy: ``"auto"`` (the ILP chooses) or a hand-written strategy name / object.
      time_limit_s: wall-clock budget of the whole call, tracing included (see
        ``autopar.planner.budget``); the best plan found in it is returned.
      deterministic: never stop on the wall clock, only on the solver's deterministic clock:
        the same plan on every run under any load, however long the call takes. Default False,
        or True when the environment sets ``AUTOPAR_DETERMINISTIC=1``.
      pipeline: ``"auto"`` or a dict pinning some of ``axis``, ``stages``,
        ``microbatches``, ``schedule``, ``virtual_stages``: split the step into pipeline
        stages over a mesh axis (``autopar.pipeline``; the step must declare its layers, e.g.
        ``autopar.pipeline.model.gpt_train_step``). Run the plan with
        ``autopar.autoparallel(fn, mesh=..., plan=plan)`` (or decorate the step with
        ``@autoparallel(mesh=..., pipeline=...)``).
      kernels: fused Pallas kernels (``autopar.kernels``) in place of XLA's ops: "never" (the
        default: the kernels' cost entries are not yet checked against GPU timings, and their
        sites add solver time), "auto" (the ILP chooses each where its cost model says so; on
        GPU profiles only, see ``validate.kernels``) or "always" (wherever the plan's layouts
        allow one; on CPU devices they run in Pallas' interpreter, slowly). ``Plan.kernels``
        lists what was chosen.
      memory_decisions: the trades the planner may make where no layout fits
        ``memory_budget``: ``"recompute"`` (the backward pass recomputes what the forward pass
        saved: scanned layers, and unrolled ones off CPU; ``Plan.recompute``) and
        ``"offload"`` (the optimizer's state waits in host memory between steps,
        ``Plan.offload``); both by default, ``()`` for neither.

    Returns:
      An ``autopar.Plan``.

    Raises:
      AutoparError: for any bad input (its subclasses say which kind); the message names what
        was given, where, and the fix.
    """
    validate.reject_unknown(options, PLAN_OPTIONS, "plan")
    validate.callable_fn(fn, "autopar.plan")
    _require_mesh(mesh, "plan")
    if mesh_search.is_open(mesh):
        return _plan_open_mesh(fn, args, mesh, hardware=hardware, memory_budget=memory_budget,
                               strategy=strategy, donate_argnums=donate_argnums,
                               time_limit_s=time_limit_s, deterministic=deterministic,
                               pipeline=pipeline, kernels=kernels,
                               memory_decisions=memory_decisions)
    _check_options(dict(hardware=hardware, memory_budget=memory_budget, strategy=strategy,
                        time_limit_s=time_limit_s, deterministic=deterministic,
                        kernels=kernels, memory_decisions=memory_decisions), mesh)
    staged = strategies.pipelined(strategy)
    if staged is not None:     # megatron_3d: pins its own pipeline, planned by the pipeline's
        _no_graph_objects(args, "plan")
        if pipeline is not None:
            raise AutoparError(f"autopar.plan(strategy={staged.name!r}, pipeline={pipeline!r}): "
                               f"the strategy pins its own pipeline (stage axis, microbatches, "
                               f"schedule); drop pipeline=, or plan with strategy='auto' and "
                               f"pipeline= to have the planner choose")
        if len(args) != 2:
            raise AutoparError(f"strategy {staged.name!r} pipelines a step of (state, batch) "
                               f"that declares its layers (autopar.pipeline.model); "
                               f"autopar.plan got {len(args)} arguments")
        return staged.plan(fn, *args, mesh=mesh, hardware=hardware, memory_budget=memory_budget,
                           time_limit_s=time_limit_s)
    if pipeline is not None:   # inter-op: see autopar.pipeline
        from autopar.pipeline import planning

        _no_graph_objects(args, "plan")
        return planning.plan(fn, args, mesh, hardware=hardware, memory_budget=memory_budget,
                             pipeline=pipeline, time_limit_s=time_limit_s, strategy=strategy,
                             donate_argnums=donate_argnums)
    call = arguments.prepare(args)
    user_layout = _user_layout(strategy, call.dynamic)
    graph, trace_s = _trace_call(fn, call, validate.donate_argnums(donate_argnums))
    return plan_graph(graph, mesh, hardware=hardware, memory_budget=memory_budget,
                      strategy=strategy, time_limit_s=time_limit_s, trace_s=trace_s,
                      deterministic=deterministic, kernels=kernels, user_layout=user_layout,
                      memory_decisions=memory_decisions)


def _user_layout(strategy, args):
    """The arguments' committed layout: the strategy for ``strategy="user"`` (an error without
    one), a start auto is held against (when the arguments carry one), else None."""
    from autopar.strategies.user import from_arrays, resolve

    if strategy == "user":
        return resolve(strategy, args)
    return from_arrays(*args) if strategy in (None, "auto") else None


def _trace_call(fn: Callable, call, donate_argnums) -> tuple[ir.Graph, float]:
    """Trace ``fn`` on a call's arguments as a decorated step would: parted
    (``autopar.arguments.prepare``)."""
    traced, _ = call.function(fn, donate_argnums)
    return trace_abstract(traced, call.dynamic, donate_argnums)


def _plan_open_mesh(fn, args, mesh, *, hardware, strategy, donate_argnums, time_limit_s,
                    pipeline, **options) -> Plan:
    """``autopar.plan`` where ``mesh=`` leaves the shape open (``autopar.mesh_search``): the
    step traced once, each shape planned on it, the fastest that fits returned."""
    if pipeline is not None:
        return _plan_open_pipeline(fn, args, mesh, hardware=hardware, strategy=strategy,
                                   donate_argnums=donate_argnums, time_limit_s=time_limit_s,
                                   pipeline=pipeline, memory_budget=options["memory_budget"])
    if strategies.pipelined(strategy) is not None:
        mesh_search.check_not_open(mesh, "strategy='megatron_3d'")
    if strategy == "user":
        raise ShardingError("strategy='user' plans the layouts the arguments are committed to, "
                            "on their mesh; give that mesh instead of leaving its shape open")
    hw, shapes = mesh_search.checked(mesh, hardware)
    _check_options(dict(hardware=hw, strategy=strategy, time_limit_s=time_limit_s, **options),
                   shapes[0])
    call = arguments.prepare(args)
    graph, trace_s = _trace_call(fn, call, validate.donate_argnums(donate_argnums))
    if not isinstance(mesh, Mapping) and _has_experts(graph):   # a count or a device list
        hw, shapes = mesh_search.checked(mesh, hardware, mesh_search.EXPERT_AXES)
    left = max(validate.time_limit(time_limit_s) - trace_s, 0.0)
    return mesh_search.plan_over_shapes(
        shapes, lambda sizes, t: plan_graph(graph, sizes, hardware=hw, strategy=strategy,
                                            time_limit_s=t + trace_s, trace_s=trace_s,
                                            **options), left)


def _has_experts(graph: ir.Graph) -> bool:
    """Whether the step has a mixture of experts' stacked expert weights (an expert dim among
    its parameters' logical names): an open mesh then gets an expert axis too."""
    return any(a.kind == "param" and "expert" in a.names for a in strategies.annotate(graph))


def _plan_open_pipeline(fn, args, mesh, *, hardware, strategy, donate_argnums, time_limit_s,
                        pipeline, memory_budget) -> Plan:
    """``autopar.plan(..., pipeline=...)`` over an open mesh: every ``{stage, data, model}``
    shape (the stage axis named by ``pipeline``'s ``axis``, at least 2 stages) planned by the
    pipeline planner, the fastest that fits returned."""
    from autopar.pipeline import planning

    _no_graph_objects(args, "plan")
    axis = pipeline.get("axis", "stage") if isinstance(pipeline, dict) else "stage"
    hw, shapes = mesh_search.checked(mesh, hardware, (axis, "data", "model"), {axis: 2})
    return mesh_search.plan_over_shapes(
        shapes, lambda sizes, t: planning.plan(
            fn, args, sizes, hardware=hw, memory_budget=memory_budget, pipeline=pipeline,
            time_limit_s=t, strategy=strategy, donate_argnums=donate_argnums),
        validate.time_limit(time_limit_s))


def trace_abstract(fn: Callable, args: tuple, donate_argnums=()) -> tuple[ir.Graph, float]:
    """``(graph, seconds)`` of ``fn(*args)`` traced from unsharded abstract arguments (arrays
    committed to a mesh trace as jax traces them there: jax.random adds reshards)."""
    return _trace(fn, args, validate.leaf_types(args, run=False), donate_argnums)


def _no_graph_objects(args: tuple, where: str) -> None:
    if arguments.has_graph_objects(args):
        raise AutoparError(f"{where}(pipeline=...) takes the step's state as plain pytrees "
                           f"(state, batch), not NNX objects: split them first "
                           f"(graphdef, state = nnx.split(model)) and merge inside the step, "
                           f"or plan without pipeline=")


def _require_mesh(mesh, where: str) -> None:
    if mesh is None:
        raise ShardingError(f"{where}() needs mesh=: a jax.sharding.Mesh, an AbstractMesh or a "
                            f"dict of axis sizes, e.g. mesh={{'data': 2, 'model': 4}}")


AUTOPARALLEL_OPTIONS = PLAN_OPTIONS + ("plan",)


class AutoParallel:
    """A training step that plans, compiles and runs itself sharded (``@autopar.autoparallel``).

    Lowers and runs under its own Auto-axis mesh, so a caller inside ``jax.set_mesh(...)``
    (Explicit axes) gets the same executable as one outside it, except that the step is traced
    under that mesh's axes (as Auto): constraints the step makes only under a mesh (flax's
    ``nn.with_logical_constraint``) are then part of it (``autopar.planner.constraints``).
    """

    def __init__(self, fn: Callable, *, mesh, hardware=None, memory_budget=None,
                 strategy="auto", donate_argnums=(), time_limit_s: float = 30.0,
                 plan: Plan | None = None, deterministic: bool | None = None,
                 host_local_argnums=(), kernels: str = "never",
                 memory_decisions=validate.MEMORY_DECISIONS, tune=False):
        validate.callable_fn(fn, "autopar.autoparallel")
        functools.update_wrapper(self, fn)
        self.fn = fn
        _require_mesh(mesh, "autoparallel")
        self.options = dict(hardware=hardware, memory_budget=memory_budget, strategy=strategy,
                            time_limit_s=time_limit_s, deterministic=deterministic,
                            kernels=kernels, memory_decisions=memory_decisions)
        # mesh= may leave its shape to the planner (autopar.mesh_search): chosen on the first
        # call, and kept for every later signature (the state lives on one mesh)
        self._open_mesh = mesh if mesh_search.is_open(mesh) else None
        if self._open_mesh is not None:
            if plan is not None or host_local_argnums not in ((), None):
                mesh_search.check_not_open(mesh, "autoparallel with plan= or host_local_argnums=")
            hw, shapes = mesh_search.checked(mesh, hardware)
            _check_options(dict(self.options, hardware=hw), shapes[0])
            self.mesh = None
        else:
            self.mesh = concrete_mesh(mesh)
            _check_options(self.options, self.mesh)
        self.donate_argnums = validate.donate_argnums(donate_argnums)
        self._given_plan = _given_plan(plan, self.options, self.mesh)
        # tune=: the first call of a signature times auto's plan against the runners-up the
        # cost model cannot tell apart from it (autopar.tune)
        self._tune = validate.tune(tune, strategy, plan)
        if self._tune is not None and host_local_argnums not in ((), None):
            raise AutoparError("tune= times plans on the step's arguments, which host-local "
                               "batches are not yet (each process holds other rows): drop "
                               "tune= or host_local_argnums=")
        self._searched: dict[str, Plan] = {}    # graph fingerprint -> the mesh search's plan
        # Arguments holding this process's rows of the batch (see autopar.distributed).
        self.host_local_argnums = ((host_local_argnums,) if isinstance(host_local_argnums, int)
                                   else tuple(host_local_argnums))
        self._cache: dict[tuple, _Entry] = {}
        self._executables: dict[tuple, Any] = {}
        # The usual call's shortcut (``_fast_hit``): (argument tree, each leaf's shape, dtype
        # and weak type) -> (cache key, entry, each leaf's planned sharding), for signatures
        # whose arguments are arrays alone. Emptied whenever an entry is (re)built.
        self._fast: dict[tuple, tuple] = {}
        self._last: Plan | None = None
        self._last_key: tuple | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan of the last signature this step was called or lowered with."""
        return self._last

    def _prepared(self, args: tuple, run: bool):
        """``args`` parted (``autopar.arguments``: NNX objects split, static leaves apart) and
        checked: (the call, its traced leaves' types, its cache key)."""
        call = arguments.prepare(args)
        types = validate.leaf_types(call.dynamic, run=run)
        # placing arrays changes no type: one key for both
        return call, types, (call.key, validate.signature(call.dynamic, types))

    def _compiled(self, call: arguments.Call, types, key, given: Plan | None = None,
                  measure: bool = False) -> _Entry:
        """The entry of ``key``, planned (and built) on first use. ``measure``: ``call``'s
        arguments are arrays on the mesh's devices, so a tuned step (``tune=``) times its
        candidates on them; an entry planned without (``lower`` of abstract arguments: its
        plan's ``tuned`` is empty, where a tuned plan holds at least auto's row) is planned
        again, tuned, at the first call that can."""
        hit = self._cache.get(key)
        tune = (self._tune is not None and measure and given is None
                and self._given_plan is None)
        if hit is None or given is not None or (tune and not hit.plan.tuned):
            fn, results = call.function(self.fn, self.donate_argnums)
            traced = distributed.global_args(call.dynamic, self.host_local_argnums)
            if traced is not call.dynamic:
                types = validate.leaf_types(traced, run=False)
            graph, trace_s = _trace(fn, traced, types, self.donate_argnums)
            distributed.check_same_graph(graph)       # no-ops in a one-process job
            user = _user_layout(self.options["strategy"], traced)
            exe = None
            if tune:
                from autopar import tune as tuning

                self._searched.pop(graph.fingerprint(), None)   # tuned on the chosen mesh
                plan, exe = tuning.choose(graph, self.mesh, self.options, traced,
                                          validate.abstract(traced, types), trace_s=trace_s,
                                          user_layout=user, within=self._tune)
            else:
                plan = self._plan_for(graph, trace_s, given, user)
            distributed.check_same_plan(plan)
            jitted, in_shardings = codegen.build(graph, plan, self.mesh, self.donate_argnums)
            hit = _Entry(plan, jitted, in_shardings, graph, results)
            self._cache[key] = hit
            self._executables.pop(key, None)
            if exe is not None and not self.donate_argnums:     # compiled as the step runs it
                hit.exe = self._executables[key] = exe
            self._fast.clear()
        self._last = hit.plan
        return hit

    def _plan_for(self, graph: ir.Graph, trace_s: float, given: Plan | None = None,
                  user_layout=None) -> Plan:
        given = given if given is not None else self._given_plan
        given = given if given is not None else self._searched.pop(graph.fingerprint(), None)
        if given is not None:
            validate.check_plan_mesh(given, self.mesh)
            validate.plan_applies(given, graph)
            return given.with_trees(graph.in_tree, graph.out_tree)
        return plan_graph(graph, self.mesh, trace_s=trace_s, user_layout=user_layout,
                          **self.options)

    def _choose_mesh(self, args: tuple) -> None:
        """Where ``mesh=`` left the shape open and none is chosen yet: plan ``args`` over every
        shape (``autopar.plan``), keep the chosen shape's device mesh and its plan."""
        if self.mesh is not None:
            return
        made = plan(self.fn, *args, mesh=self._open_mesh, donate_argnums=self.donate_argnums,
                    **self.options)
        self.mesh = mesh_search.concrete(self._open_mesh, made.mesh_shape)
        self._searched[made.graph_fingerprint] = made

    def __call__(self, *args, **kwargs):
        _no_kwargs(self, kwargs)
        fast = self._fast_hit(args)
        if fast is not None:
            return self._run_fast(*fast)
        self._choose_mesh(args)
        call, types, key = self._prepared(args, run=True)
        with on_mesh(self.mesh):
            entry = self._compiled(call, types, key, measure=True)   # the key's one lookup
            if entry.exe is None:
                entry.exe = self._executables[key] = self._compile(entry, self._abstract(call))
            self._remember_fast(call, types, key, entry)
            return self._run(call, key, entry, entry.exe)

    def _fast_hit(self, args: tuple):
        """``(hit, leaves, treedef)`` where ``args`` are arrays alone, live and outside any
        transform, of a signature already run (``_remember_fast``); else None, and the call
        takes the whole path (``_prepared``: parting, checks, messages). The whole path costs
        about 20 us a leaf in Python (paths and dtype names for its messages): 1.5 ms a call on
        a 72-leaf step, 10-15% of a small model's step on CPU devices."""
        if not self._fast:
            return None
        leaves, treedef = jax.tree_util.tree_flatten(args)
        sig = []
        for x in leaves:
            if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)
                    or x.is_deleted()):
                return None
            sig.append((x.shape, x.dtype, getattr(x, "weak_type", False)))  # a PRNG key has none
        hit = self._fast.get((treedef, tuple(sig)))
        return None if hit is None else (hit, leaves, treedef)

    def _remember_fast(self, call: arguments.Call, types, key, entry: _Entry) -> None:
        """Let later calls of ``call``'s signature take ``_fast_hit``: only where every leaf is
        traced (no NNX object, no static leaf, no host-local argument to globalise)."""
        if (call.nodes or self.host_local_argnums or entry.exe is None
                or any(k != arguments.TRACED for k in call.kinds)):
            return
        treedef = jax.tree_util.tree_structure(call.dynamic)
        shardings = treedef.flatten_up_to(entry.in_shardings)
        sig = tuple((tuple(t.shape), t.dtype, bool(getattr(t, "weak_type", False)))
                    for t in types)
        self._fast[(treedef, sig)] = (key, entry, tuple(shardings))

    def _run_fast(self, hit: tuple, leaves: list, treedef):
        """``_run`` for a ``_fast_hit``: what it does for arguments that are arrays alone."""
        key, entry, shardings = hit
        placed = treedef.unflatten([_place(x, s) for x, s in zip(leaves, shardings)])
        self._last, self._last_key = entry.plan, key
        with on_mesh(self.mesh):
            return entry.results.rebuild_out(entry.exe(*placed), ())

    def _run(self, call: arguments.Call, key, entry: _Entry, exe):
        """Move the traced arguments into their planned layouts, run, write NNX changes back.
        NNX objects keep the moved arrays: the state the step leaves unchanged (an RNG key, a
        frozen layer) moves once, not at every call."""
        args = distributed.place_host_local(call.dynamic, self.host_local_argnums,
                                            entry.in_shardings)
        args = jax.tree_util.tree_map(_place, args, entry.in_shardings)
        if call.nodes:
            call.adopt(args)
        self._last, self._last_key = entry.plan, key
        return call.finish(entry.results, exe(*args))

    def _abstract(self, call: arguments.Call) -> tuple:
        """The traced arguments as ShapeDtypeStructs of their global shapes: what lowering
        needs, whatever layout (or process) the arrays are in."""
        traced = distributed.global_args(call.dynamic, self.host_local_argnums)
        return validate.abstract(traced, validate.leaf_types(traced, run=False))

    def _compile(self, entry: _Entry, args):
        """Compile once per signature. Should XLA reject the constraints the plan pins inside the
        step (its partitioner has failed verification on some layouts), fall back to the plan's
        input and output layouts alone, and say so."""
        plan, jitted, graph = entry.plan, entry.jitted, entry.graph
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

    def verify(self, *args, **tolerances):
        """``autopar.verify`` of the executable of ``args``' signature (default: the last one
        called) against its plan; ``args`` as the step takes them."""
        from autopar.verify import verify

        if args:
            compiled = self.compile(*args)
            plan, exe = self._cache[compiled._key].plan, compiled.jax
        elif self._last_key is not None:
            plan, exe = self._cache[self._last_key].plan, self._executables[self._last_key]
        else:
            raise AutoparError("step.verify() needs the step to have run once, or arguments "
                               "to compile it for: step.verify(state, batch)")
        return verify(plan, exe, **tolerances)

    def lower(self, *args, **kwargs) -> Lowered:
        """Like ``jax.jit(...).lower``, for what the step takes: arrays in any layout (lowered
        for the planned one, as a call would move them), ShapeDtypeStructs, NNX objects, modules
        with static leaves. ``.compile()`` gives the executable, which runs as the step does."""
        _no_kwargs(self, kwargs)
        self._choose_mesh(args)
        call, types, key = self._prepared(args, run=False)
        with on_mesh(self.mesh):
            entry = self._compiled(call, types, key)
            return Lowered(self, key, entry.jitted.lower(*self._abstract(call)))

    def compile(self, *args, **kwargs) -> Compiled:
        """The executable of ``args``' signature (planned and compiled on first use, shared with
        the step's calls); it runs as the step does: ``step.compile(*args)(*args)``."""
        _no_kwargs(self, kwargs)
        self._choose_mesh(args)
        call, types, key = self._prepared(args, run=False)
        with on_mesh(self.mesh):
            entry = self._compiled(call, types, key, measure=_arrays(call.dynamic))
            return self._compiled_for(key, lambda: self._compile(entry, self._abstract(call)))

    def _compiled_for(self, key, make) -> Compiled:
        entry = self._cache[key]
        if entry.exe is None:
            entry.exe = self._executables[key] = make()
        return Compiled(self, key, entry.exe)

    def _call_compiled(self, key, exe, args: tuple, kwargs):
        """``Compiled.__call__``: ``args`` must have the signature ``exe`` was compiled for."""
        _no_kwargs(self, kwargs)
        fast = self._fast_hit(args)
        if fast is not None and fast[0][0] == key and fast[0][1].exe is exe:
            return self._run_fast(*fast)
        call, types, got = self._prepared(args, run=True)
        if got != key:
            raise AutoparError(
                f"this executable was compiled for other arguments: "
                f"{validate.signature_difference(key[1], got[1], call.dynamic)}. Call the step "
                f"itself (it plans and compiles once per signature), or compile for these "
                f"arguments: step.compile(*args)")
        entry = self._cache[key]
        if entry.exe is exe:
            self._remember_fast(call, types, key, entry)
        with on_mesh(self.mesh):
            return self._run(call, key, entry, exe)

    def input_shardings(self, *args, plan: Plan | None = None):
        """The ``NamedSharding`` of every traced argument leaf (a pytree like ``args``, which
        may be ShapeDtypeStructs, with each NNX object's place holding its ``nnx.State``): plans
        for this signature if needed, or applies ``plan`` to it. Use it to load arrays straight
        into their layouts (``autopar.checkpoint.restore`` does)."""
        call, types, key = self._prepared(args, run=False)
        with on_mesh(self.mesh):
            return self._compiled(call, types, key, given=plan).in_shardings


@dataclasses.dataclass
class _Entry:
    """What one signature planned and built; ``exe`` once compiled."""

    plan: Plan
    jitted: Any
    in_shardings: Any
    graph: ir.Graph
    results: arguments.Results
    exe: Any = None


def _arrays(args) -> bool:
    """Whether every leaf of ``args`` is an array with data (not a ShapeDtypeStruct or tracer)."""
    return all(isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, jax.core.Tracer)
               for x in jax.tree_util.tree_leaves(args))


def _no_kwargs(step: AutoParallel, kwargs) -> None:
    if kwargs:
        name = getattr(step.fn, "__name__", "step")
        raise AutoparError(f"{name}() got keyword arguments {sorted(kwargs)}; an autoparallel "
                           f"step takes its arguments positionally (bind fixed ones with "
                           f"functools.partial before decorating)")


def _check_options(options: dict, mesh) -> None:
    """Fail before tracing (and at decoration, not at the first call): each option is checked as
    plan_graph will check it."""
    sizes = axis_sizes(mesh)
    if options["hardware"] is not None:
        cost_models.hardware(options["hardware"])
    validate.memory_budget(options["memory_budget"])
    validate.time_limit(options["time_limit_s"])
    resolve_deterministic(options["deterministic"])
    validate.kernels(options["kernels"])
    validate.memory_decisions(options["memory_decisions"])
    _, strat = validate.strategy(options["strategy"])
    if strat is not None and hasattr(strat, "axes"):
        strat.axes(sizes)


def _given_plan(plan, options: dict, mesh) -> Plan | None:
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise PlanError(f"plan={validate.short(plan)} ({type(plan).__name__}) is not an "
                        f"autopar.Plan; load a saved one with plan=autopar.Plan.from_json(text)")
    ignored = [k for k in ("hardware", "memory_budget") if options[k] is not None]
    ignored += ["strategy"] if options["strategy"] not in (None, "auto") else []
    ignored += ["kernels"] if options["kernels"] != "never" else []
    ignored += (["memory_decisions"] if validate.memory_decisions(options["memory_decisions"])
                != validate.MEMORY_DECISIONS else [])
    if ignored:
        raise AutoparError(f"plan= applies a saved plan without solving, so "
                           f"{', '.join(k + '=' for k in ignored)} would be ignored; drop "
                           f"{'them' if len(ignored) > 1 else 'it'} or drop plan=")
    validate.check_plan_mesh(plan, mesh, "the loaded plan")
    return plan


def _place(x, sharding):
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(distributed.local_value(x, sharding), sharding)


def autoparallel(fn: Callable | None = None, *, mesh=None, hardware=None,
                 memory_budget: float | None = None, strategy="auto", donate_argnums=(),
                 time_limit_s: float = 30.0, plan: Plan | None = None,
                 deterministic: bool | None = None, host_local_argnums=(), kernels: str = "never",
                 pipeline=None, memory_decisions=validate.MEMORY_DECISIONS, tune=False,
                 **options):
    """Decorate a training step so it runs sharded over ``mesh`` by a plan autopar chooses.

    ``autoparallel(fn, mesh=...)`` and ``@autoparallel(mesh=...)`` both work. The first call with
    a new abstract signature traces, plans and compiles; later calls reuse the executable. The
    step takes what ``nnx.jit`` and ``eqx.filter_jit`` take (see ``autopar.arguments``): Flax
    NNX objects, whose every change the step writes back into them after the call, and pytrees
    whose non-array leaves are static (part of the signature, as ``eqx.filter_jit`` keys them).
    ``plan=`` applies a saved plan (``Plan.from_json``) without solving. The options are those of
    ``autopar.plan``; every one is checked here, before the first call. Under
    ``jax.distributed`` every process calls the step alike; the arguments in
    ``host_local_argnums`` hold this process's rows of the batch (see ``autopar.distributed``).
    ``pipeline=`` (or ``plan=`` a pipelined plan) runs the step pipelined (``autopar.pipeline``).
    ``tune=True`` makes the first call of each signature time auto's plan against every
    hand-written strategy's and the user's layout predicted within the hardware's measured
    ranking error of it (``autopar.tune.band``: 25% on the CPU profile, at least 10%; or
    ``tune=`` a fraction), on the call's own arguments, and run the fastest (``autopar.tune``;
    ``Plan.tuned`` holds the times): for machines and models where the cost model's error is
    larger than the gaps between its best plans.
    """
    validate.reject_unknown(options, AUTOPARALLEL_OPTIONS, "autoparallel")
    staged = strategies.pipelined(strategy) if plan is None else None
    if pipeline is not None or getattr(plan, "pipeline", None) is not None or staged:
        _pipelined_only(strategy=None if staged else strategy, donate_argnums=donate_argnums,
                        host_local_argnums=host_local_argnums, kernels=kernels,
                        deterministic=deterministic, tune=tune)
        options = dict(hardware=hardware, memory_budget=memory_budget, time_limit_s=time_limit_s)
        if staged:
            options["strategy"] = staged
        make = functools.partial(_Pipelined, mesh=mesh, pipeline=pipeline, plan=plan, **options)
        return make if fn is None else make(fn)

    def wrap(f):
        return AutoParallel(f, mesh=mesh, hardware=hardware, memory_budget=memory_budget,
                            strategy=strategy, donate_argnums=donate_argnums,
                            time_limit_s=time_limit_s, plan=plan, deterministic=deterministic,
                            host_local_argnums=host_local_argnums, kernels=kernels,
                            memory_decisions=memory_decisions, tune=tune)

    return wrap(fn) if fn is not None else wrap


# ---- pipelined steps (autopar.pipeline) --------------------------------------------------------
def _pipelined_only(**given) -> None:
    """Options a pipelined step does not take yet (its stages' layouts and donation are the
    pipeline runtime's own)."""
    defaults = dict(strategy="auto", donate_argnums=(), host_local_argnums=(), kernels="never",
                    deterministic=None, tune=False)
    bad = [k for k, v in given.items() if v is not None and v != defaults[k]]
    if bad:
        raise AutoparError(f"autoparallel(pipeline=...) does not combine with "
                           f"{', '.join(k + '=' for k in bad)} yet: a pipelined step's layouts, "
                           f"kernels and donation are the pipeline runtime's own; drop "
                           f"{'them' if len(bad) > 1 else 'it'} or drop pipeline=")


class _Pipelined:
    """``@autoparallel(pipeline=...)``, or ``plan=`` a pipelined plan: per argument signature,
    ``autopar.plan(..., pipeline=...)`` (or the given plan) and the pipelined step that runs it
    (``autopar.pipeline.planning.executable``). The step must declare its layers
    (``autopar.pipeline.model``); it takes ``(state, batch)`` and returns ``(state, loss)``."""

    def __init__(self, fn: Callable, *, mesh, pipeline=None, plan: Plan | None = None,
                 **plan_options):
        validate.callable_fn(fn, "autopar.autoparallel")
        functools.update_wrapper(self, fn)
        _require_mesh(mesh, "autoparallel")
        # an open mesh (autopar.mesh_search) is shaped, stage count included, on the first call
        self._open_mesh = mesh if mesh_search.is_open(mesh) else None
        if self._open_mesh is not None and plan is not None:
            mesh_search.check_not_open(mesh, "autoparallel with plan=")
        self.fn = fn
        self.mesh = None if self._open_mesh is not None else concrete_mesh(mesh)
        staged = plan is None and "strategy" in plan_options
        self.pipeline = "auto" if pipeline is None and plan is None and not staged else pipeline
        self._given, self._options = plan, plan_options
        self._runs: dict[tuple, tuple[Plan, Any]] = {}
        self._last: Plan | None = None

    @property
    def plan(self) -> Plan | None:
        """The plan of the last signature this step was called with."""
        return self._last

    def __call__(self, *args, **kwargs):
        """One pipelined step. An unrolled model's state in its own layout (the first call's,
        typically) is converted to the stacked layout the step runs on and returns
        (``stack_state``; ``unstack_state`` converts back)."""
        from autopar.pipeline.model import staged_model_of
        from autopar.pipeline.unrolled import stacked_state

        _no_kwargs(self, kwargs)
        _no_graph_objects(args, "autoparallel")
        if len(args) == 2:
            stacking = staged_model_of(self.fn, args).stacking
            args = (stacked_state(stacking, args[0], abstract=False), args[1])
        return self._step(args, run=True)(*args)

    def lower(self, *args, **kwargs):
        """Like ``jax.jit(...).lower``: arguments may be ShapeDtypeStructs (an unrolled model's
        in its own layout too: lowered in the stacked layout the step runs on)."""
        from autopar.pipeline.planning import stacked_args

        _no_kwargs(self, kwargs)
        _no_graph_objects(args, "autoparallel")
        args = stacked_args(self.fn, args)
        return self._step(args, run=False).jitted(*args).lower(*args)

    def stack_state(self, state):
        """An unrolled model's state (``autopar.pipeline.unrolled``) in the stacked layout the
        pipelined step runs on and returns; ``unstack_state`` converts back."""
        from autopar.pipeline.model import staged_model_of
        from autopar.pipeline.unrolled import stacked_state

        return stacked_state(staged_model_of(self.fn).stacking, state, abstract=False)

    def unstack_state(self, state):
        from autopar.pipeline.model import staged_model_of

        stacking = staged_model_of(self.fn).stacking
        if stacking is None:
            return state
        try:
            params = stacking.params_of(state)
        except AutoparError:        # not a training state of this step: as it is
            return state
        return state if stacking.layout(params) != "stacked" else stacking.unstack_state(state)

    def _step(self, args, run: bool):
        """The pipelined step of ``args``' signature, planned on its first use."""
        from autopar.pipeline import planning

        key = validate.signature(args, validate.leaf_types(args, run=run))
        if key not in self._runs:
            if run:     # an unrolled model's own layout is refused before planning it
                planning.stacked_args(self.fn, args, run=True)
            made = self._given or plan(self.fn, *args, mesh=self.mesh or self._open_mesh,
                                       pipeline=self.pipeline, **self._options)
            if self.mesh is None:       # the shape the search chose, kept for later calls
                self.mesh = mesh_search.concrete(self._open_mesh, made.mesh_shape)
            self._runs[key] = (made, planning.executable(made, self.fn, self.mesh))
        self._last, step = self._runs[key]
        return step
