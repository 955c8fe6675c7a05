"""``autopar.Plan``: what the planner decided, what it predicts, and how to print and save it.

A plan is immutable and serialises to JSON (never pickle). It keeps the graph's fingerprint so a
loaded plan is applied only to the function it was made for.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Any

import jax

from autopar import jsonread as J
from autopar.errors import AutoparError, PlanError
from autopar.sharding import Sharding, to_spec

# 2: the graph fingerprint covers op parameters, literals and donation (1 did not).
# 3: pins address every layout (slot, chain); collectives carry count, source and name; the cost
#    has bytes by collective kind and HBM bytes.
# 4: a plan may carry a pipeline (``autopar.pipeline.record.PipelinePlan``, null when none).
# 5: kernels: the fused kernels the plan runs in place of XLA's ops.
# 6: recompute: the loops whose saved values the backward pass recomputes, and how.
# 7: offload: the arguments held in host memory between steps.
# 8: mesh_candidates: the mesh shapes the planner tried where the call left the shape open.
# 9: pipeline.runtime: "lockstep" or "mpmd" (an 8 plan's pipeline ran lockstep).
# 10: solver.ruled_out: the faster start the memory budget ruled out (optional on load).
# 11: tuned: the plans a tuned step timed before it chose (``autoparallel(tune=...)``).
# 12: constraints: the step's own sharding constraints, and the layouts the plan gives them.
FORMAT_VERSION = 12
# Prefix of the strategy names of ops run replicated for want of a rule (planner.rules uses it).
FALLBACK = "replicated: "
PIN_SLOTS = ("out", "in", "arg", "res")
KERNELS = ("attention", "norm", "xent", "adamw")


@dataclasses.dataclass(frozen=True)
class Pin:
    """A layout codegen enforces inside the step (see ``autopar.planner.pins``): at the equation
    or region ``path``, the value in ``slot`` (``out``, ``in``, ``arg``, ``res``) number ``index``
    passes through the layouts of ``chain``, ending in the plan's."""

    path: tuple[int, ...]
    slot: str
    index: int
    chain: tuple[Sharding, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the plan issues. ``nbytes`` is per device and per execution, sized as HLO
    sizes it (the result for all-reduce, all-gather, all-to-all and collective-permute, the
    operand for reduce-scatter: the ``cost_models`` conventions); ``count`` is how often it runs
    per step (a scan body's trip count), and ``time_s`` already includes it."""

    where: str                 # "op17 dot_general @ model.py:31" or "edge op12:arg1 ..."
    kind: str
    axes: tuple[str, ...]
    nbytes: float
    time_s: float
    count: float = 1.0
    source: str = ""           # the user's "file.py:LINE" of the op it belongs to
    name: str = ""             # that op's name stack ("jvp(GPT)/layer_0/mlp/fc1")
    hbm_bytes: float = 0.0     # per execution: what it and its layout copies read and write


@dataclasses.dataclass(frozen=True)
class KernelUse:
    """One fused kernel the plan runs in place of XLA's ops (``autopar.planner.kernel_choice``):
    codegen calls its forward half for ``op_ids`` and its backward half for ``bwd_op_ids``, each
    in ``shard_map`` with the per-shard specs ``split`` gives. ``kernel_s`` (kernel and its
    collectives) and ``xla_s`` (the replaced ops under the plan's layouts) are predicted
    seconds per step."""

    kernel: str                                         # one of KERNELS
    op_ids: tuple[int, ...]
    bwd_op_ids: tuple[int, ...]
    sources: tuple[str, ...]
    split: tuple[tuple[str, tuple[str, ...]], ...]      # kernel dim -> mesh axes
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]  # argument, PartitionSpec, shard shape
    kernel_s: float
    xla_s: float


@dataclasses.dataclass(frozen=True)
class RejectedKernel:
    """A place a fused kernel could replace XLA's ops (an ``ir.patterns`` match) that the plan
    leaves to XLA, and why (``autopar.planner.kernel_sites`` and ``kernel_choice``): the match
    is inside a loop body, its mask or shapes are ones the kernel cannot take, no layout of the
    plan fits the kernel's splits, or (``kernels="auto"``) XLA's ops are predicted faster."""

    kernel: str                                         # one of KERNELS
    op_ids: tuple[int, ...]                             # the forward match's ops
    sources: tuple[str, ...]
    module: str                                         # module path, "model/layers/0/attn"
    reason: str


@dataclasses.dataclass(frozen=True)
class Recompute:
    """A planner decision: at one forward/backward loop pair of the step (``ir.recompute``: a
    scanned model's layers), or over its repeated unrolled layers where it has no loop pair
    (``ir.recompute_unrolled``, site 0), the backward recomputes what the forward saved for it,
    under ``policy`` (``"selective"``: the attention core, from the kept queries and keys;
    ``"save_dots"``: from the layer input and the kept matmul outputs; ``"save_weight_dots"``:
    from the layer input and the kept outputs of the weight matmuls; ``"full"``: from the
    layer input alone). Codegen rewrites the step accordingly."""

    site: int                 # index among ``ir.recompute.sites_of(graph)``
    policy: str               # one of ir.recompute.POLICIES other than "none"
    where: str                # the forward loop's name stack and source line (or the layers')
    dropped_bytes: float      # all devices: the saved values no longer kept
    stacked_bytes: float      # all devices: the values kept instead (layer inputs, matmuls)
    #                           (unrolled: the layer inputs kept only for the replay)
    replayed_flops: float     # per step, all devices: matmul FLOPs the backward replays
    no_recompute_peak_bytes: float | None = None  # per device: the same step's best plan
    #                                               without it (None: not solved)

    def __str__(self) -> str:
        before = ("" if self.no_recompute_peak_bytes is None else
                  f"; without it the peak is {_gib(self.no_recompute_peak_bytes)}/device")
        return (f"recompute {self.policy} at {self.where}: {_gib(self.dropped_bytes)} of saved "
                f"values (all devices) recomputed from {_gib(self.stacked_bytes)} kept, "
                f"{self.replayed_flops / 1e9:.3g} GFLOP of matmuls replayed{before}")


@dataclasses.dataclass(frozen=True)
class Offload:
    """A planner decision: arguments the step keeps in host memory (``memory_kind=
    "pinned_host"``) between steps and updates on the device in turn (``ir.offload``: one
    group, e.g. one parameter's Adam moments), returning their new values to the host."""

    inputs: tuple[int, ...]   # flat argument positions
    outputs: tuple[int, ...]  # flat result positions of their updated values
    paths: tuple[str, ...]    # the arguments' pytree paths
    host_bytes: float         # per device: what the group holds in host memory during the step
    #                           (its arguments; its results too where they are not donated)
    transfer_s: float         # per step: its moves to the device and back, over the host link
    no_offload_peak_bytes: float | None = None  # per device: the best plan without offload

    def __str__(self) -> str:
        names = ", ".join(self.paths[:3]) + (f" and {len(self.paths) - 3} more"
                                             if len(self.paths) > 3 else "")
        size = (_gib(self.host_bytes) if self.host_bytes >= 2**30
                else f"{self.host_bytes / 2**20:.3g} MiB")
        return (f"offload {names}: {size}/device in host memory, moved in and out in "
                f"{_ms(self.transfer_s)} per step")


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    step_time_s: float
    compute_s: float
    comm_s: float              # collectives the ops issue (partial sums, reductions)
    transition_s: float        # resharding between ops
    peak_memory_bytes: float
    memory_budget_bytes: float | None
    comm_by_kind: tuple[tuple[str, float], ...]
    dispatch_s: float = 0.0    # launching the step's program, once
    comm_bytes_by_kind: tuple[tuple[str, float], ...] = ()   # per device per step, HLO's sizes
    hbm_bytes: float = 0.0     # per device per step: bytes the fused kernels read and write

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {_ms(t)}" for k, t in self.comm_by_kind) or "none"
        launch = f" + launch {_ms(self.dispatch_s)}" if self.dispatch_s else ""
        return (f"step {_ms(self.step_time_s)} = compute {_ms(self.compute_s)} + collectives "
                f"{_ms(self.comm_s)} + resharding {_ms(self.transition_s)}{launch}; peak memory "
                f"{_gib(self.peak_memory_bytes)}/device; communication by kind: {kinds}")


@dataclasses.dataclass(frozen=True)
class SolverStats:
    status: str
    gap: float | None        # against a bound of the whole problem; None: unknown (candidates)
    solve_s: float
    build_s: float
    trace_s: float
    num_groups: int
    num_vars: int
    num_constraints: int
    candidates: int = 0      # > 0: solved over at most this many strategies per decision group
    folded: int = 0          # > 0: planned with this many copies of a repeated layer folded out
    # The cheapest hand-written start the memory budget ruled out, where it is predicted faster
    # than the plan: (its name, its step in s, its peak in bytes per device). The budget binds
    # the plan's layouts; recomputation may buy that speed back (``planner.make_plan``).
    ruled_out: tuple[str, float, float] | None = None


@dataclasses.dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape the planner tried where ``mesh=`` left the shape open
    (``autopar.mesh_search``): its predicted step and peak, or why it has no plan."""

    mesh: tuple[tuple[str, int], ...]
    step_time_s: float | None
    peak_memory_bytes: float | None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class TunedCandidate:
    """One plan a tuned step (``autoparallel(tune=...)``, ``autopar.tune``) compiled and timed on
    its own arguments before choosing: its strategy, predicted step, the median of its timed
    rounds (None when it could not be timed, ``error`` saying why) and the candidate whose
    program it shares (equal lowered text: timed once, under that name)."""

    strategy: str
    step_time_s: float
    measured_s: float | None
    same_as: str = ""
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One of the step's own ``with_sharding_constraint`` calls (``autopar.planner.constraints``):
    its source line, the layout it asks for (``*``: a dim it leaves unconstrained), the layout
    the plan gives that value (which codegen runs), and whether the two agree."""

    source: str
    asked: str
    planned: str
    followed: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sharding plan for one function and one abstract signature.

    ``input_shardings``/``output_shardings`` are flat, in the order of the flattened arguments
    and results; ``input_specs``/``output_specs`` give them as pytrees of ``PartitionSpec``.
    ``pins`` are every layout codegen enforces inside the step (``Pin``); ``kernels`` the fused
    kernels it runs in place of XLA's ops (``KernelUse``), ``rejected_kernels`` the places
    one could go that it leaves to XLA, and why (``RejectedKernel``; empty with
    ``kernels="never"``).
    """

    mesh: tuple[tuple[str, int], ...]
    hardware: str
    strategy: str
    graph_fingerprint: str
    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_shardings: tuple[Sharding, ...]
    output_shardings: tuple[Sharding, ...]
    pins: tuple[Pin, ...]
    choices: tuple[tuple[int, str, str, str], ...]      # (op id, prim, source, strategy name)
    collectives: tuple[Collective, ...]
    cost: CostBreakdown
    solver: SolverStats
    kernels: tuple[KernelUse, ...] = ()
    rejected_kernels: tuple[RejectedKernel, ...] = ()
    in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
    notes: tuple[str, ...] = ()   # what a hand-written strategy could not place, and why
    pipeline: Any = None       # autopar.pipeline.record.PipelinePlan of a pipelined plan
    recompute: tuple[Recompute, ...] = ()   # what the backward pass recomputes (memory)
    offload: tuple[Offload, ...] = ()       # what lives in host memory between steps (memory)
    mesh_candidates: tuple[MeshCandidate, ...] = ()   # shapes tried for an open mesh= (best first)
    tuned: tuple[TunedCandidate, ...] = ()   # plans timed before choosing (the chosen first)
    constraints: tuple[Constraint, ...] = ()  # the step's own sharding constraints, as planned

    # ---- views ------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def input_specs(self):
        """Pytree (like the arguments) of ``PartitionSpec``; a path->spec dict without a tree."""
        return _spec_tree(self.input_shardings, self.in_tree, self.input_paths)

    @property
    def output_specs(self):
        """Pytree (like the results) of ``PartitionSpec``; a path->spec dict without a tree."""
        return _spec_tree(self.output_shardings, self.out_tree, self.output_paths)

    def spec_of(self, path_fragment: str):
        """The spec of the one input whose pytree path contains ``path_fragment``."""
        hits = [k for k, p in enumerate(self.input_paths) if str(path_fragment) in p]
        if len(hits) != 1:
            raise PlanError(f"{len(hits)} inputs match {path_fragment!r}; give a fragment of "
                            f"exactly one input path, e.g. {list(self.input_paths[:5])}")
        return to_spec(self.input_shardings[hits[0]])

    @property
    def replicated_fallbacks(self) -> tuple[tuple[int, str, str, str], ...]:
        """(op id, primitive, source line, reason) of every op the planner ran replicated for
        want of a way to shard it: no sharding rule for its primitive, a ``while``/``cond`` whose
        body is not planned, or the time limit reached before its strategies were enumerated.
        Read from ``choices``: their strategy names start with ``"replicated: "``."""
        return tuple((op_id, prim, src, name[len(FALLBACK):])
                     for op_id, prim, src, name in self.choices if name.startswith(FALLBACK))

    def collective_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    # ---- text -------------------------------------------------------------------------------
    def summary(self, max_rows: int = 40) -> str:
        from autopar.explain import summary

        text = summary(self, max_rows)
        return text if self.pipeline is None else text + "\n" + self.pipeline.summary()

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        from autopar.explain import html

        return html(self)

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("in_tree"), d.pop("out_tree")
        d["format_version"] = FORMAT_VERSION
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan ``to_json`` wrote, checked field by field (types, the format version, mesh
        axes that exist and divide the input shapes); any flaw is a ``PlanError`` naming it."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError, RecursionError) as e:
            raise PlanError(f"Plan.from_json: the text is not JSON ({e}); pass what "
                            f"Plan.to_json() wrote") from None
        version = d.get("format_version", FORMAT_VERSION) if isinstance(d, dict) else None
        if version != FORMAT_VERSION and isinstance(version, int) and not isinstance(version,
                                                                                     bool):
            raise PlanError(f"Plan.from_json: the plan has format_version {version}; this autopar "
                            f"reads version {FORMAT_VERSION} (see FORMAT_VERSION's history in "
                            f"autopar/plan.py): plan again with this version")
        try:
            return _plan_from_dict(d)
        except AutoparError as e:
            raise PlanError(f"Plan.from_json: {e}. The file is damaged or was edited: plan "
                            f"again and save plan.to_json()") from None

    def with_trees(self, in_tree, out_tree) -> Plan:
        return dataclasses.replace(self, in_tree=in_tree, out_tree=out_tree)


# ---- reading JSON -----------------------------------------------------------------------------
def _plan_from_dict(d) -> Plan:
    _check_top(d)
    sizes = _mesh(d["mesh"])
    ins, outs = J.texts(d["input_paths"], "input_paths"), J.texts(d["output_paths"], "output_paths")
    shapes = tuple(J.shape(x, f"input_shapes[{k}]") for k, x in
                   enumerate(J.seq(d["input_shapes"], "input_shapes", len(ins))))
    return Plan(
        mesh=tuple(sizes.items()), hardware=J.text(d["hardware"], "hardware"),
        strategy=J.text(d["strategy"], "strategy"),
        graph_fingerprint=J.text(d["graph_fingerprint"], "graph_fingerprint"),
        input_paths=ins, output_paths=outs, input_shapes=shapes,
        input_shardings=_in_layouts(d["input_shardings"], ins, shapes, sizes),
        output_shardings=tuple(_layout(s, sizes, f"output_shardings[{k}] ({outs[k]})") for k, s
                               in enumerate(J.seq(d["output_shardings"], "output_shardings",
                                                  len(outs)))),
        pins=tuple(_pin(x, sizes, k) for k, x in enumerate(J.seq(d["pins"], "pins"))),
        choices=tuple(_choice(x, k) for k, x in enumerate(J.seq(d["choices"], "choices"))),
        collectives=tuple(_collective(x, sizes, k)
                          for k, x in enumerate(J.seq(d["collectives"], "collectives"))),
        cost=_cost(d["cost"]), solver=_solver_stats(d["solver"]),
        notes=J.texts(d.get("notes", []), "notes"),
        pipeline=_pipeline(d["pipeline"], sizes),
        kernels=tuple(_kernel_use(x, sizes, k)
                      for k, x in enumerate(J.seq(d["kernels"], "kernels"))),
        rejected_kernels=tuple(_rejected(x, k) for k, x in enumerate(
            J.seq(d.get("rejected_kernels", []), "rejected_kernels"))),
        recompute=tuple(_recompute(x, k) for k, x in enumerate(
            J.seq(d["recompute"], "recompute"))),
        offload=_offloads(d["offload"], len(ins), len(outs)),
        mesh_candidates=tuple(_mesh_candidate(x, k) for k, x in enumerate(
            J.seq(d["mesh_candidates"], "mesh_candidates"))),
        tuned=tuple(_tuned(x, k) for k, x in enumerate(J.seq(d["tuned"], "tuned"))),
        constraints=tuple(_constraint(x, k) for k, x in enumerate(
            J.seq(d["constraints"], "constraints"))))


def _pipeline(x, sizes):
    from autopar.pipeline.record import from_dict

    return from_dict(x, sizes)


def _check_top(d) -> None:
    if not isinstance(d, dict):
        raise PlanError(f"a plan is a JSON object; got {type(d).__name__}")
    version = d.get("format_version")
    if "format_version" not in d:
        raise PlanError("it has no format_version field, so Plan.to_json() did not write it")
    if version != FORMAT_VERSION:
        raise PlanError(f"format_version {version!r} is not {FORMAT_VERSION}, the version this "
                        f"autopar reads")
    fields = {f.name for f in dataclasses.fields(Plan)} - {"in_tree", "out_tree"}
    unknown = sorted(set(d) - fields - {"format_version"})
    # absent from plans saved before they were recorded
    missing = sorted(fields - set(d) - {"notes", "rejected_kernels"})
    if unknown or missing:
        raise PlanError(f"unknown fields {unknown} / missing fields {missing}")


def _mesh(x, where: str = "mesh") -> dict[str, int]:
    from autopar.mesh import axis_sizes

    pairs = J.pairs(x, where)
    names = [J.text(a, f"{where}[{k}] axis name") for k, (a, _) in enumerate(pairs)]
    if len(set(names)) != len(names):
        raise PlanError(f"mesh {pairs} repeats an axis name")
    return axis_sizes(dict(pairs))


def _in_layouts(value, paths, shapes, sizes) -> tuple[Sharding, ...]:
    from autopar.sharding import layout_for

    return tuple(layout_for(s, shapes[k], sizes, f"input_shardings[{k}] (input {paths[k]})",
                            PlanError)
                 for k, s in enumerate(J.seq(value, "input_shardings", len(paths))))


def _layout(value, sizes, where: str) -> Sharding:
    from autopar.sharding import layout

    return layout(value, sizes, where, PlanError)


def _pin(x, sizes, k: int) -> Pin:
    where = f"pins[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(Pin)])
    path = tuple(J.integer(i, f"{where}.path") for i in J.seq(d["path"], f"{where}.path"))
    slot = J.choice(d["slot"], f"{where}.slot", PIN_SLOTS, "a pin's slot")
    chain = tuple(_layout(s, sizes, f"{where}.chain[{j}]")
                  for j, s in enumerate(J.seq(d["chain"], f"{where}.chain")))
    if not chain:
        raise PlanError(f"{where}.chain is empty; a pin names at least the layout it enforces")
    return Pin(path, slot, J.integer(d["index"], f"{where}.index"), chain)


def _choice(x, k: int):
    op, prim, source, name = J.seq(x, f"choices[{k}]", 4)
    return (J.integer(op, f"choices[{k}] op id"), J.text(prim, f"choices[{k}]"),
            J.text(source, f"choices[{k}]"), J.text(name, f"choices[{k}]"))


def _collective(x, sizes, k: int) -> Collective:
    where = f"collectives[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(Collective)],
                 optional=("hbm_bytes",))    # plans saved before it was recorded
    axes = J.texts(d["axes"], f"{where}.axes")
    for a in axes:
        if a not in sizes:
            raise PlanError(f"{where} names mesh axis {a!r}, but the mesh has axes {sizes}")
    num = {n: J.number(d.get(n, 0.0), f"{where}.{n}")
           for n in ("nbytes", "time_s", "count", "hbm_bytes")}
    return Collective(J.text(d["where"], where), J.text(d["kind"], where), axes,
                      num["nbytes"], num["time_s"], num["count"],
                      J.text(d["source"], f"{where}.source"), J.text(d["name"], f"{where}.name"),
                      num["hbm_bytes"])


def _kernel_use(x, sizes, k: int) -> KernelUse:
    where = f"kernels[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(KernelUse)])
    kernel = J.choice(d["kernel"], f"{where}.kernel", KERNELS, "a kernel")
    split = tuple((J.text(n, f"{where}.split"), J.texts(axes, f"{where}.split"))
                  for n, axes in J.pairs(d["split"], f"{where}.split"))
    for _, axes in split:
        for a in axes:
            if a not in sizes:
                raise PlanError(f"{where}.split names mesh axis {a!r}, but the mesh has axes "
                                f"{sizes}")
    specs = tuple(_spec_entry(e, f"{where}.specs[{j}]")
                  for j, e in enumerate(J.seq(d["specs"], f"{where}.specs")))
    ids = {n: tuple(J.integer(i, f"{where}.{n}") for i in J.seq(d[n], f"{where}.{n}"))
           for n in ("op_ids", "bwd_op_ids")}
    if not ids["op_ids"]:
        raise PlanError(f"{where}.op_ids is empty; a kernel replaces at least one op")
    return KernelUse(kernel, ids["op_ids"], ids["bwd_op_ids"],
                     J.texts(d["sources"], f"{where}.sources"), split, specs,
                     J.number(d["kernel_s"], f"{where}.kernel_s"),
                     J.number(d["xla_s"], f"{where}.xla_s"))


def _rejected(x, k: int) -> RejectedKernel:
    where = f"rejected_kernels[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(RejectedKernel)])
    kernel = J.choice(d["kernel"], f"{where}.kernel", KERNELS, "a kernel")
    return RejectedKernel(kernel, tuple(J.integer(i, f"{where}.op_ids")
                                        for i in J.seq(d["op_ids"], f"{where}.op_ids")),
                          J.texts(d["sources"], f"{where}.sources"),
                          J.text(d["module"], f"{where}.module"),
                          J.text(d["reason"], f"{where}.reason"))


def _recompute(x, k: int) -> Recompute:
    from ir.recompute import POLICIES

    where = f"recompute[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(Recompute)])
    policy = J.choice(d["policy"], f"{where}.policy", POLICIES[1:], "a recompute policy")
    before = d["no_recompute_peak_bytes"]
    return Recompute(J.integer(d["site"], f"{where}.site"), policy,
                     J.text(d["where"], f"{where}.where"),
                     J.number(d["dropped_bytes"], f"{where}.dropped_bytes"),
                     J.number(d["stacked_bytes"], f"{where}.stacked_bytes"),
                     J.number(d["replayed_flops"], f"{where}.replayed_flops"),
                     None if before is None else J.number(before, f"{where}.no_recompute_peak"))


def _offloads(x, n_in: int, n_out: int) -> tuple[Offload, ...]:
    out, seen = [], set()
    for k, item in enumerate(J.seq(x, "offload")):
        where = f"offload[{k}]"
        d = J.fields(item, where, [f.name for f in dataclasses.fields(Offload)])
        ins = tuple(J.integer(i, f"{where}.inputs") for i in J.seq(d["inputs"], f"{where}.inputs"))
        outs = tuple(J.integer(i, f"{where}.outputs")
                     for i in J.seq(d["outputs"], f"{where}.outputs", len(ins)))
        for i, n, what in [(i, n_in, "argument") for i in ins] + [(j, n_out, "result")
                                                                   for j in outs]:
            if not 0 <= i < n:
                raise AutoparError(f"{where}: {what} {i} is out of range (the step has {n})")
        if seen & set(ins):
            raise AutoparError(f"{where}: argument(s) {sorted(seen & set(ins))} are offloaded "
                               f"twice")
        seen |= set(ins)
        before = d["no_offload_peak_bytes"]
        out.append(Offload(ins, outs, J.texts(d["paths"], f"{where}.paths"),
                           J.number(d["host_bytes"], f"{where}.host_bytes"),
                           J.number(d["transfer_s"], f"{where}.transfer_s"),
                           None if before is None else J.number(before,
                                                                f"{where}.no_offload_peak_bytes")))
    return tuple(out)


def _mesh_candidate(x, k: int) -> MeshCandidate:
    where = f"mesh_candidates[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(MeshCandidate)])
    step, peak = d["step_time_s"], d["peak_memory_bytes"]
    if (step is None) != (peak is None) or (step is None) == (not d["error"]):
        raise AutoparError(f"{where}: a candidate has a step time and peak, or an error")
    return MeshCandidate(tuple(_mesh(d["mesh"], f"{where}.mesh").items()),
                         None if step is None else J.number(step, f"{where}.step_time_s"),
                         None if peak is None else J.number(peak, f"{where}.peak_memory_bytes"),
                         J.text(d["error"], f"{where}.error") if d["error"] else "")


def _tuned(x, k: int) -> TunedCandidate:
    where = f"tuned[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(TunedCandidate)])
    measured = d["measured_s"]
    if (measured is None) == (not d["error"]):
        raise AutoparError(f"{where}: a timed candidate has a measured step or an error")
    return TunedCandidate(J.text(d["strategy"], f"{where}.strategy"),
                          J.number(d["step_time_s"], f"{where}.step_time_s"),
                          None if measured is None else J.number(measured, f"{where}.measured_s"),
                          J.text(d["same_as"], f"{where}.same_as"),
                          J.text(d["error"], f"{where}.error"))


def _constraint(x, k: int) -> Constraint:
    where = f"constraints[{k}]"
    d = J.fields(x, where, [f.name for f in dataclasses.fields(Constraint)])
    asked, planned = J.text(d["asked"], f"{where}.asked"), J.text(d["planned"], f"{where}.planned")
    if not isinstance(d["followed"], bool):
        raise AutoparError(f"{where}.followed={d['followed']!r} must be true or false")
    dims = [re.findall(r"\*|R|-|S\([^)]*\)", t) for t in (asked, planned)]
    if d["followed"] != (len(dims[0]) == len(dims[1])
                         and all(a in ("*", p) for a, p in zip(*dims))):
        raise AutoparError(f"{where}: followed={d['followed']} disagrees with asked {asked!r} "
                           f"and planned {planned!r}")
    return Constraint(J.text(d["source"], f"{where}.source"), asked, planned, d["followed"])


def _spec_entry(x, where: str) -> tuple[str, str, tuple[int, ...]]:
    arg, spec, shape = J.seq(x, where, 3)
    return J.text(arg, where), J.text(spec, where), J.shape(shape, where)


def _cost(x) -> CostBreakdown:
    names = [f.name for f in dataclasses.fields(CostBreakdown)]
    d = J.fields(x, "cost", names, optional=("dispatch_s",))
    pairs = {n: _kind_pairs(d[n], f"cost.{n}") for n in ("comm_by_kind", "comm_bytes_by_kind")}
    budget = d["memory_budget_bytes"]
    nums = {n: J.number(d[n], f"cost.{n}") for n in names
            if n in d and n not in pairs and n != "memory_budget_bytes"}
    return CostBreakdown(**nums, **pairs, memory_budget_bytes=None if budget is None
                         else J.number(budget, "cost.memory_budget_bytes"))


def _kind_pairs(x, where: str) -> tuple[tuple[str, float], ...]:
    return tuple((J.text(k, where), J.number(t, where))
                 for k, t in (J.seq(p, where, 2) for p in J.seq(x, where)))


def _solver_stats(x) -> SolverStats:
    d = J.fields(x, "solver", [f.name for f in dataclasses.fields(SolverStats)],
                 optional=("candidates", "folded", "ruled_out"))
    d = {"candidates": 0, "folded": 0, "ruled_out": None, **d}
    ints = ("num_groups", "num_vars", "num_constraints", "candidates", "folded")
    ruled = d["ruled_out"]
    if ruled is not None:
        name, step, peak = J.seq(ruled, "solver.ruled_out", 3)
        ruled = (J.text(name, "solver.ruled_out"), J.number(step, "solver.ruled_out"),
                 J.number(peak, "solver.ruled_out"))
    return SolverStats(status=J.text(d["status"], "solver.status"), ruled_out=ruled,
                       gap=None if d["gap"] is None else J.number(d["gap"], "solver.gap"),
                       **{n: J.number(d[n], f"solver.{n}") for n in ("solve_s", "build_s",
                                                                  "trace_s")},
                       **{n: J.integer(d[n], f"solver.{n}") for n in ints})


def _spec_tree(shardings, tree, paths):
    specs = [to_spec(s) for s in shardings]
    if tree is None:   # a plan loaded from JSON before it was applied to its function
        return dict(zip(paths, specs))
    return _unboxed(jax.tree_util.tree_unflatten(tree, specs))


def _unboxed(tree):
    """``tree`` with each metadata box (an NNX ``Variable``, a flax ``Partitioned`` or other
    ``AxisMetadata``) replaced by the one spec it holds: plain ``PartitionSpec``s, and still a
    tree prefix of the arguments, so usable as a ``jax.jit``'s ``in_shardings``."""
    boxes = _box_types()
    if not boxes:
        return tree
    return jax.tree_util.tree_map(
        lambda x: jax.tree_util.tree_leaves(x)[0] if isinstance(x, boxes) else x, tree,
        is_leaf=lambda x: isinstance(x, boxes))


def _box_types() -> tuple[type, ...]:
    """Flax's box types, when the program imported flax (no box exists otherwise)."""
    nnx, meta = sys.modules.get("flax.nnx"), sys.modules.get("flax.core.meta")
    return ((nnx.Variable,) if nnx is not None else ()) + (
        (meta.AxisMetadata,) if meta is not None else ())


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"
