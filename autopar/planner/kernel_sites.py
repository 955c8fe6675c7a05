"""Kernel sites: the places a fused kernel may replace XLA's ops, each with its layout options.

A *site* is a forward match of ``ir.patterns`` (attention, norm + residual, LM-head
cross-entropy, AdamW update) together with its backward match: codegen replaces both with the
kernel's forward and backward halves (``autopar.kernels.halves``), or neither. A site is offered
only when the substitution is sound (``_unsound``):

  * every replaced op sits at the top level of the step or inside inlined ``jit`` calls (not
    in a scan body, nor under remat or a custom derivative, which codegen retraces whole);
  * every value a replaced op makes that anything else reads is one the kernel writes (the
    forward's output, the backward's gradients); the probabilities, statistics and other
    residuals the XLA backward read are the kernel's business;
  * the kernel can run where its outputs are first needed: each half's inputs are read before
    its first output is made, and the forward's outputs come before the backward's.

Every match that is no site is returned with the reason (``rejected``, which
``kernel_choice`` adds to with the sites a plan leaves to XLA): ``Plan.rejected_kernels``.

An *option* is one way of splitting the kernel's dims over mesh axes (``kernel_rules``): it
fixes the layout of each interface value, the kernel's time and its collectives. An option is
kept only when every interface value's decision group offers its layout. The XLA side of the
comparison is each replaced op's cost under every strategy of its group, as
``problem._Builder.add_costs`` prices it (``savings``): choosing the kernel removes it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from autopar.plan import RejectedKernel
from autopar.planner import problem
from autopar.planner.kernel_rules import RULES, Comm, KernelRule, Split, kernel_of
from autopar.sharding import Sharding, enumerate_shardings
from ir.layers import module_path
from ir.patterns import Index, Match, find_patterns

# How a plan uses kernels (``PlannerOptions.kernels``): "auto" lets the ILP weigh each kernel
# against XLA's ops, "always" takes one wherever the layouts allow, "never" offers none.
MODES = ("auto", "always", "never")


@dataclasses.dataclass(frozen=True)
class Option:
    """One layout of a site: its split, the layout it needs of each interface value (the
    anchor's first), the kernel's predicted seconds (compute; ``comm_s`` its collectives)."""

    split: Split
    layouts: tuple[tuple[int, Sharding], ...]
    compute_s: float
    comm_s: float
    comms: tuple[Comm, ...]
    specs: tuple[tuple[str, str, tuple[int, ...]], ...]

    @property
    def anchor_layout(self) -> Sharding:
        return self.layouts[0][1]

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclasses.dataclass(frozen=True)
class Site:
    """A forward match (and its backward) one kernel may replace.

    ``savings``: group id -> per strategy, (compute, collective) seconds of the replaced ops
    under that strategy (what XLA's code costs there).
    """

    kernel: str
    fwd: Match
    bwd: Match | None
    replaced: frozenset[int]
    anchor: int
    options: tuple[Option, ...]
    savings: Mapping[int, tuple[np.ndarray, np.ndarray]]

    def option_for(self, anchor_layout: Sharding) -> Option | None:
        return next((o for o in self.options if o.anchor_layout == anchor_layout), None)

    def saved_s(self, choice: Sequence[int]) -> tuple[float, float]:
        """(compute, collective) seconds of the replaced ops under the plan ``choice``."""
        comp = sum(float(c[choice[g]]) for g, (c, _) in self.savings.items())
        comm = sum(float(m[choice[g]]) for g, (_, m) in self.savings.items())
        return comp, comm


def rejected(graph, kernel: str, fwd: Match, reason: str) -> RejectedKernel:
    """The plan's record of a match left to XLA (``Plan.rejected_kernels``), with the module
    path its ops share (``model/layers/0/self_attn``)."""
    paths = [module_path(graph.op(i).name).split("/") for i in fwd.op_ids if graph.op(i).name]
    common = paths[0] if paths else []
    for p in paths[1:]:
        n = next((k for k, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common),
                                                                              len(p)))
        common = common[:n]
    return RejectedKernel(kernel, fwd.op_ids, fwd.sources, "/".join(common), reason)


def find_sites(prob: problem.Problem, cost_model) -> tuple[list[Site], list[RejectedKernel]]:
    """Every sound site of ``prob``'s graph with at least one layout its groups can take, and
    every other match with the reason it is not one."""
    matches = find_patterns(prob.graph)
    index = Index(prob.graph)
    backward = {m.forward: m for m in matches if m.forward is not None}
    builder = problem._Builder(prob.graph, prob.mesh, cost_model, 1, fusion=prob.fusion)
    sites, skipped = [], []
    for i, fwd in enumerate(matches):
        if fwd.forward is not None:
            continue
        kernel = kernel_of(fwd.pattern)
        rule, bwd = RULES[kernel], backward.get(i)
        reason = _placement(index, fwd, bwd) or _missing(fwd, bwd, rule) or \
            rule.check(index, fwd, bwd) or _unsound(index, fwd, bwd, rule)
        options = () if reason else _options(prob, index, fwd, bwd, rule, cost_model)
        if not reason and not options:
            reason = "no layout of the plan's groups fits the kernel's splits"
        if reason:
            skipped.append(rejected(prob.graph, kernel, fwd, reason))
            continue
        replaced = frozenset(fwd.op_ids) | frozenset(bwd.op_ids if bwd else ())
        sites.append(Site(kernel, fwd, bwd, replaced, options[0].layouts[0][0], options,
                          _savings(prob, builder, index, replaced)))
    return sites, skipped


# ---- soundness --------------------------------------------------------------------------------
def _placement(index: Index, fwd: Match, bwd: Match | None) -> str | None:
    """Why codegen cannot replace the ops where they are: in a loop body, under remat or a
    custom derivative."""
    for i in sorted(set(fwd.op_ids) | set(bwd.op_ids if bwd else ())):
        op = index.ops[index.order[i]]
        if index.scope[i] is not None:
            return f"op{i} {op.prim} is inside a loop body (kernels replace top-level ops only)"
        if op.scope:
            return f"op{i} {op.prim} is inside {op.scope[-1]} (rematerialised or custom " \
                   f"derivative code is retraced whole)"
    return None


def _unsound(index: Index, fwd: Match, bwd: Match | None, rule: KernelRule) -> str | None:
    ops = set(fwd.op_ids) | set(bwd.op_ids if bwd else ())
    return _leaks(index, fwd, bwd, rule, ops) or _out_of_order(index, fwd, bwd, rule, ops)


def _missing(fwd: Match, bwd: Match | None, rule: KernelRule) -> str | None:
    """The roles the kernel reads that the match lacks."""
    missing = [r for r in rule.reads if r not in rule.optional and r not in fwd.roles()]
    missing += [r for r in rule.cotangents if bwd is not None and r not in rule.optional
                and r not in bwd.roles()]
    return f"the match has no {missing}" if missing else None


def _leaks(index: Index, fwd: Match, bwd: Match | None, rule: KernelRule,
           ops: set[int]) -> str | None:
    """A value the replaced ops make, that the kernel does not, and that something reads."""
    provided = {v for r, v in fwd.outputs if r in rule.writes_fwd}
    provided |= {v for r, v in (bwd.outputs if bwd else ()) if r in rule.writes_bwd}
    returned = set(index.graph.outputs)     # sites are top level: no region results
    for i in sorted(ops, key=index.order.__getitem__):
        for v in index.ops[index.order[i]].outs:
            if v in provided:
                continue
            readers = [c for c in index.consumers.get(v, ()) if c.id not in ops]
            if readers or v in returned:
                who = f"op{readers[0].id} {readers[0].prim}" if readers else "the step's result"
                return (f"%{v} {index.graph.values[v]} made by op{i} is also read by {who}, "
                        f"and the kernel does not compute it")
    return None


def available(index: Index, v: int, ops: set[int]) -> int:
    """Where (``index.order``) codegen has value ``v`` in hand: a graph input or top-level
    constant from the start (-1), else once its producer ran, if that is a top-level equation
    outside ``ops``, else at the first op of ``ops`` that reads it."""
    p = index.producer.get(v)
    top_consts = index.graph.consts[:len(getattr(index.graph.jaxpr, "consts", ()))]
    if p is None and (v in index.graph.inputs or v in top_consts):
        return -1
    if p is not None and p.id not in ops and index.scope[p.id] is None and not p.scope:
        return index.order[p.id]
    return min(index.order[c.id] for c in index.consumers.get(v, ()) if c.id in ops)


def _out_of_order(index: Index, fwd: Match, bwd: Match | None, rule: KernelRule,
                  ops: set[int]) -> str | None:
    """Each half runs when one of its outputs is first read outside the replaced ops (codegen
    defers it until then): all it reads must be computed before that point, the forward's
    inputs too when the backward runs the forward first."""
    def first_use(m: Match, roles) -> float:
        return min((index.order[c.id] for r, v in m.outputs if r in roles
                    for c in index.consumers.get(v, ()) if c.id not in ops), default=math.inf)

    def ready(m: Match, roles) -> int:
        return max((available(index, v, ops) for r, v in m.inputs if r in roles), default=-1)

    checks = [(fwd, ready(fwd, rule.reads), first_use(fwd, rule.writes_fwd))]
    if bwd is not None:
        need = max(ready(bwd, rule.cotangents), ready(fwd, rule.reads))
        checks.append((bwd, need, first_use(bwd, rule.writes_bwd)))
    for m, need, use in checks:
        if need >= use:
            return (f"an output of {m.pattern} is read (at op {index.ops[int(use)].id}) before "
                    f"all its inputs are computed (op {index.ops[need].id})")
    return None


# ---- options ----------------------------------------------------------------------------------
def splits(slots: Sequence[tuple[str, int]], mesh: Mapping[str, int],
           max_axes: int = 2) -> list[Split]:
    """Every assignment of the mesh's axes (size > 1) to at most one slot each, at most
    ``max_axes`` per slot (mesh order inside a slot), each slot's size divisible: the
    shardings of a shape whose dims are the slots."""
    names = [name for name, _ in slots]
    return [tuple(zip(names, s))
            for s in enumerate_shardings([size for _, size in slots], mesh, max_axes)]


def _options(prob: problem.Problem, index: Index, fwd: Match, bwd: Match | None,
             rule: KernelRule, cm) -> tuple[Option, ...]:
    out = []
    for split in splits(rule.slots(index, fwd), prob.mesh):
        named = dict(split)
        layouts = rule.layouts(index, fwd, bwd, named)
        if not all(_offered(prob, v, s) for v, s in layouts.items()):
            continue
        cost, comms = rule.cost(index, fwd, bwd, named, prob.mesh)
        dtype = index.graph.values[next(iter(layouts))].dtype
        comm_s = sum(cm.collective_time_s(kind, nbytes, axes) for kind, nbytes, axes in comms)
        specs = rule.specs(index, fwd, bwd, named, prob.mesh)
        out.append(Option(split, tuple(layouts.items()), cost.time_s(cm.hw, dtype), comm_s,
                          comms, specs))
    return tuple(out)


def _offered(prob: problem.Problem, v: int, layout: Sharding) -> bool:
    g = prob.group_of_value.get(v)
    return g is not None and layout in prob.groups[g].shard[v]


# ---- the XLA side -----------------------------------------------------------------------------
def _savings(prob: problem.Problem, builder, index: Index,
             replaced: frozenset[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per group holding replaced ops: their (compute, collective) seconds per strategy, priced
    by the builder that priced the problem (so the two sides subtract exactly)."""
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i in sorted(replaced):
        g = prob.group_of_op.get(i)
        grp = prob.groups[g] if g is not None and g >= 0 else None
        if grp is None or i not in grp.members:
            continue
        scratch = problem.Group(-1, -1, grp.strategies, np.zeros(grp.n), np.zeros(grp.n),
                                 np.zeros(grp.n))
        builder.add_costs(scratch, index.ops[index.order[i]], grp.members[i], grp.mults[i])
        comp, comm = out.get(g, (np.zeros(grp.n), np.zeros(grp.n)))
        out[g] = (comp + scratch.compute_s, comm + scratch.comm_s)
    return out
