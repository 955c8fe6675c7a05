"""The wall-clock budget of one plan call, and the few progress lines long planning prints.

``time_limit_s`` (L below) bounds the whole ``autopar.plan`` call, tracing included. Each stage
that can stop early checks the clock (``Clock``):

  stage                         rule
  tracing                       cannot stop
  problem build                 ops reached after SEARCH_BEFORE * L get no sharding rule: they
                                run replicated (a valid plan; only many-axis meshes get there)
  descent from the free start   skipped after SEARCH_BEFORE * L: each decision group then takes
                                its cheapest strategy alone (descent's edge matrices cost about
                                as much as the build)
  hand-written starts           each tried only while the call is under START_BEFORE * L;
                                their CP-SAT solves stop at START_BEFORE * L or after
                                MIN_SOLVE_FRACTION * L, the later, and (not a time rule: a
                                proof) a solve of the whole model once its bound shows it
                                cannot beat a plan in hand that fits (``ilp.solve``'s beat_s)
  ILP                           skipped after SEARCH_BEFORE * L when the start fits the memory
                                budget; its model build stops at BUDGET_FACTOR * L, and CP-SAT
                                at BUDGET_FACTOR * L or after MIN_SOLVE_FRACTION * L, the later
  smallest-budget search        the same CP-SAT limits, after an infeasible budget

So a call returns in about BUDGET_FACTOR * L plus the one step that was running when its stage's
limit passed. CP-SAT also keeps its deterministic limit of L: a solve that the wall clock does
not cut gives the same plan on every run. With ``deterministic=True`` the wall clock cuts nothing
(every start is tried, CP-SAT stops on its deterministic clock only): the same plan on any machine
under any load, however long that takes. ``AUTOPAR_DETERMINISTIC=1`` makes that the default (the
test suite sets it, as its golden plans must not depend on the machine's load).

Where no plan fits the memory budget, the memory decisions (``planner.recompute``'s policies,
``planner.offload``'s sets) are searched on the call's clock. Until a rewritten step fits,
each is planned in a whole limit of its own (a shared one left a tight step's first fitting
policy unfitted on a loaded machine). Once a plan is in hand (or, for Mist's trade,
``planner._traded``, from the start), the later steps are planned with the call's time (the
trade: the search's) already spent, and none is started after START_BEFORE * L (a heuristic
cut, written in the plan's notes; counted from the plain plan's failure, it let transformers'
Llama-7B at two sequences a device, ``selective`` in hand at the end of a 10 s call, plan
``save_dots`` too, to lose, in about 5 s more). A rewritten step whose bound proves it
cannot beat the plan in hand is skipped unplanned (``planner.prune``). So a call whose step
breaks its budget returns in about (2 + k) * BUDGET_FACTOR * L, k the rewritten steps planned
before one fits (0 where the first policy tried fits; where nothing fits, every policy,
offload set and pairing of the two), plus what the rewrites take (a few seconds on a 7B
model).

Progress goes to the ``"autopar"`` logger: INFO while the call is young, WARNING (which Python
prints on stderr when logging is not configured) once it has run PROGRESS_AFTER_S seconds, and
at most a handful of lines per call.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

LOG = logging.getLogger("autopar")
START_BEFORE = 1.0
SEARCH_BEFORE = 2.0
BUDGET_FACTOR = 3.0
MIN_SOLVE_FRACTION = 0.25
PROGRESS_AFTER_S = 10.0
# Meshes with more axes of size > 1 than this take long to build (every contraction enumerates
# (classes + 1) ** axes placements before pruning): say so before starting.
MANY_AXES = 4


@dataclasses.dataclass(frozen=True)
class Clock:
    """The budget of one plan call: ``start`` (``time.perf_counter``), ``limit_s`` (L)."""

    start: float
    limit_s: float
    deterministic: bool = False
    solve_until: float = BUDGET_FACTOR   # a solve's wall-clock cap, a multiple of the limit

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def spent(self, fraction: float = 1.0) -> bool:
        """Has the call run past ``fraction`` of its budget? Never, when deterministic."""
        return not self.deterministic and self.elapsed_s() > fraction * self.limit_s

    def solver_wall_s(self) -> float:
        """Wall seconds a solver may still run: what is left of the budget, at least the floor."""
        if self.deterministic or math.isinf(self.limit_s):
            return math.inf
        return max(self.solve_until * self.limit_s - self.elapsed_s(),
                   MIN_SOLVE_FRACTION * self.limit_s)

    def for_starts(self) -> Clock:
        """This clock, with solves cut at START_BEFORE * L (at least the floor): a
        hand-written start's own solve is a start, not the search (transformers' Llama-7B at
        one sequence a device: one start's cut round ran CP-SAT for 13 s of a 10 s limit, to
        end over the budget)."""
        return dataclasses.replace(self, solve_until=START_BEFORE)

    def note(self, message: str) -> None:
        """One progress line: INFO, or WARNING once the call has run long."""
        level = logging.WARNING if self.elapsed_s() > PROGRESS_AFTER_S else logging.INFO
        LOG.log(level, "autopar: %s (%.1f s into planning, time_limit_s=%g)", message,
                self.elapsed_s(), self.limit_s)


def warn_many_axes(mesh, clock: Clock) -> None:
    axes = [a for a, n in mesh.items() if n > 1]
    if len(axes) > MANY_AXES:
        LOG.warning(
            "autopar: the mesh %s has %d axes of size > 1; building the planning problem grows "
            "as (placements per op) ** axes and cannot stop at time_limit_s=%g. Merging axes "
            "(e.g. one 'data' axis of their product) plans much faster.", dict(mesh), len(axes),
            clock.limit_s)
