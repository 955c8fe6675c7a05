"""A bound that lets the memory decisions' search skip a rewritten step without planning it.

A memory decision (``planner.recompute``'s policies, ``planner.offload``'s sets) rewrites the
step and plans the new step whole, which costs a full plan call. Before that, the new step's
problem is built alone (no descent, no solve: a few tenths of a second on a 7B model) and
``ilp.lower_bound_s`` read off it: every root's cheapest strategy alone, resharding free,
all-reduce launches free, plus the dispatch, which lies below every plan's predicted step. A
rewritten step whose bound is at or above the step of a plan already in hand cannot beat it:
the skip is a proof by the planner's own cost model, not a guess. It holds for the problem the
plan call builds (no op filter, no pinned input: the memory decisions are offered only then;
a build the time limit cuts only offers fewer strategies, which raises the plan's cost), and
is not offered where kernels are chosen (a kernel site can price an op below its cheapest
strategy here).

No memory bound is used to skip a step that cannot fit: ``ilp.memory_lower_bound`` (the
solver's memory model) is not below the full estimate the budget is checked against (a small
scanned GPT's ``selective`` step on one device: 106.0 MB by the bound, 105.5 MB by
``memory.estimate``, whose buffer pooling the bound does not model), so it could skip a step
that fits.
"""
from __future__ import annotations

import dataclasses
import time

from autopar.planner import ilp, problem


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A lower bound on every plan of one step's predicted step (s); ``build_s``: the seconds
    building its problem took."""

    step_s: float
    build_s: float


def offered(options) -> bool:
    """Whether ``bounds`` is valid for a plan call under ``options`` (see the module doc)."""
    return (options.kernels == "never" and options.op_filter is None
            and not options.fixed_inputs)


def bounds(graph, mesh, cost_model, options) -> Bounds | None:
    """``Bounds`` of ``graph``'s plans on ``mesh``, None where they are not offered."""
    if not offered(options):
        return None
    t0 = time.perf_counter()
    prob = problem.build(graph, dict(mesh), cost_model, host_inputs=options.host_inputs)
    return Bounds(ilp.lower_bound_s(prob, cost_model, {}), time.perf_counter() - t0)


def cannot_beat(graph, mesh, cost_model, options, best_s: float | None) -> Bounds | None:
    """``graph``'s ``Bounds`` where they prove no plan of it is faster than ``best_s`` (the
    step of the plan in hand; None: no plan in hand, nothing to prove); else None."""
    b = None if best_s is None else bounds(graph, mesh, cost_model, options)
    return b if b is not None and b.step_s >= best_s else None
