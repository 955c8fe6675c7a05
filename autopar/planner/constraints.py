"""The step's own sharding constraints: ``jax.lax.with_sharding_constraint`` calls the user wrote
(flax's ``nn.with_logical_constraint`` makes them too, under a mesh).

The tracer reads the layout each one asks for into the op's params (``ir.params.CONSTRAINT``:
one tuple of mesh axes per dim, None for a dim left ``UNCONSTRAINED``) and the rules plan the op
as the identity, so its value's layout is a decision like any other. Then:

  * the "user" strategy (``PlannerOptions.keep_constraints``) plans the step as written: each
    constraint's group may take only the layouts that follow it (``restrict``);
  * every other strategy, auto included, chooses those layouts freely; the user's constraints
    are hints auto may start from (the user's layout is one of its starts), not bounds;
  * ``followed`` lists, for the plan, each constraint (by source line) with the layout it asks
    and the one the plan gives, in ``Plan.constraints``; codegen enforces the plan's layout in
    place of the user's, so the program runs what was priced.
"""
from __future__ import annotations

from autopar.errors import ShardingError
from autopar.plan import Constraint
from autopar.planner import problem
from autopar.sharding import Sharding, fmt
from ir.params import CONSTRAINT

PRIM = "sharding_constraint"


def _sites(prob: problem.Problem):
    """``(op, the group deciding its result, the layout it asks for)`` of every constraint
    the planner decides, in op order."""
    for op_id in sorted(prob.group_of_op):
        op = prob.graph.op(op_id)
        if op.prim == PRIM and op.param(CONSTRAINT) is not None:
            g = prob.group_of_op[op_id]
            if g >= 0 and op_id in prob.groups[g].members:
                yield op, g, op.param(CONSTRAINT)


def _readable(op) -> bool:
    return op.prim == PRIM and op.param(CONSTRAINT) is not None


def has_constraints(graph) -> bool:
    """Whether ``graph``'s step holds a sharding constraint the planner can read."""
    return any(map(_readable, graph.all_ops()))


def count(graph) -> int:
    """How many sharding constraints the planner can read ``graph``'s step holds (a forward
    constraint and its transpose in the backward pass are two)."""
    return sum(map(_readable, graph.all_ops()))


def follows(asked, have: Sharding) -> bool:
    """Whether layout ``have`` is what ``asked`` asks for (a None dim takes any layout)."""
    return len(asked) == len(have) and all(a is None or tuple(a) == tuple(h)
                                           for a, h in zip(asked, have))


def asked_text(asked) -> str:
    """``fmt`` of an asked layout, ``*`` for an unconstrained dim."""
    return "x".join("*" if a is None else fmt((tuple(a),)) for a in asked) or "-"


def restrict(prob: problem.Problem, allowed: dict[int, set[int]]) -> None:
    """Keep, in each constraint's group, only the strategies whose result follows it; a
    constraint no layout of the mesh can follow (an axis the mesh lacks, a dim the axes do
    not divide) is a ``ShardingError`` naming it."""
    for op, g, asked in _sites(prob):
        per_i = prob.groups[g].members[op.id]
        ok = {i for i, st in enumerate(per_i) if follows(asked, st.outs[0])}
        have = allowed.get(g)
        if have is not None:
            ok &= have
        if not ok:
            shape = prob.graph.values[op.outs[0]].shape
            missing = sorted({a for dim in asked if dim for a in dim} - set(prob.mesh))
            why = (f"the mesh has no axis {missing}" if missing else
                   "no layout the planner offers for it (axes dividing each split dim, at most "
                   "two per dim) is that one" if have is None else
                   "the strategy's other pins rule that layout out")
            raise ShardingError(
                f"the step's with_sharding_constraint at {op.source or op.name} asks for layout "
                f"{asked_text(asked)} of a value of shape {shape} on mesh {dict(prob.mesh)}, "
                f"and {why}. The 'user' strategy plans the step as written: plan it on a mesh "
                f"with the axes the constraint names, change the constraint, or use another "
                f"strategy (auto treats the constraint as a hint).")
        allowed[g] = ok


def followed(prob: problem.Problem, choice) -> tuple[Constraint, ...]:
    """Each distinct constraint of the step (source, asked, planned) under ``choice``."""
    out: dict[tuple, Constraint] = {}
    for op, g, asked in _sites(prob):
        have = prob.groups[g].members[op.id][choice[g]].outs[0]
        c = Constraint(op.source or op.name, asked_text(asked), fmt(have), follows(asked, have))
        out.setdefault((c.source, c.asked, c.planned), c)
    return tuple(out.values())
