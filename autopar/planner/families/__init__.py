"""Decision families: the parts the sharding ILP (``planner.ilp``) is assembled from.

A family is one kind of decision the solver makes: the layout of each decision group
(``layouts.Layouts``), a fused kernel or XLA at each kernel site (``kernels.Kernels``). Each
writes into one shared ``Model`` (the CP-SAT model, the objective's terms, the pick variables
``x``) through the methods of ``Family``:

  name                       the prefix of its constraints' names: ``layouts:pick:17``
  variables(model)           its decision variables (one-hot per group, per site, ...)
  constraints(model)         its constraints, each named ``{name}:...`` (``model.named``); a
                             variable that only linearises a constraint (a flow y) is made here
  memory(model, point)       its per-device KiB at one memory point (``Point``), as
                             (integer KiB, variable) terms; a negative term frees bytes
  objective(model)           its time terms, (integer ns, variable) pairs on ``model.obj``; a
                             term that needs its own variable (a launch set) makes it here
  start(model, pick)         solver hints for its variables that complete the start ``pick``
                             (root group -> strategy index)
  read_back(model, solver)   its part of the solution

Each method of ``Family`` itself adds nothing: a family overrides only what it brings.
``ilp._build`` calls, family by family in order, ``variables`` then ``constraints``; then, if
there is a memory budget, for each memory point the sum of every family's ``memory`` terms
within the budget (``memory:k``, a copy cut's ``memory:cut:k``); then each family's
``objective``. ``ilp._solve_model`` then calls each ``start`` and reads the choice back
(``Layouts.read_back``). A later family may read an earlier one's variables: every family
conditions on the layouts' ``model.xs(g)``. A new decision is a new family, its maker
(problem -> family) passed to ``ilp.solve`` (``families=``): nothing else in the ILP changes.

Units: times are integer nanoseconds (``ns``), bytes integer KiB (``KIB``). CP-SAT's LP works in
doubles: with picoseconds a large model's objective passed 2^53, presolve discarded a feasible
hint and the bound rose above a known solution. Nanoseconds and KiB keep every sum exact.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ortools.sat.python import cp_model

# Integer units of the model (see the module docstring).
PS = 1e9
KIB = 1024.0
# One objective term's cap (2**50 ns is 13 days): even 8192 terms at the cap sum inside int64.
MAX_NS = 2.0**50


def ns(seconds: float) -> int:
    """A cost in the model's integer nanoseconds, capped at MAX_NS so that no sum of terms can
    leave int64 (a cost that large already rules its strategy out)."""
    return int(round(min(seconds * PS, MAX_NS)))


class OutOfTime(Exception):
    """The wall-clock budget ran out while the ILP was being built."""


@dataclasses.dataclass(frozen=True)
class Point:
    """A memory point: a check point of the schedule (``Problem.mem_points``: the values live
    there, ``cut`` None) or a copy cut (``memory.CopyCut``: its live values and the resharded
    copies any plan could hold there). ``name``: its constraint's name after ``memory:``."""

    name: str
    live: tuple[int, ...] | list[int]
    cut: Any = None


class Model:
    """What the families share: the problem ``p``, the CP-SAT model ``m``, the objective's
    (ns, variable) terms ``obj``, and ``x`` (root group -> its pick variables, made by the
    layouts family)."""

    def __init__(self, p):
        self.p = p
        self.m = cp_model.CpModel()
        self.obj: list = []
        self.x: dict[int, list] = {}
        self.root = {g.id: p.root(g.id) for g in p.groups}

    def xs(self, g: int) -> list:
        """Group ``g``'s pick variables (its root's: tied groups share them)."""
        return self.x[self.root[g]]

    @staticmethod
    def named(constraint, family: Family, *where) -> None:
        """Names ``constraint`` ``family:where...`` so that explanations can find it."""
        constraint.WithName(":".join((family.name, *map(str, where))))


class Family:
    """One kind of decision (see the module docstring); each method writes into ``model``.
    The defaults add nothing: a family overrides what it brings."""

    name: str = "family"

    def variables(self, model: Model) -> None:
        """Makes its decision variables."""

    def constraints(self, model: Model) -> None:
        """Adds its named constraints."""

    def memory(self, model: Model, point: Point) -> list[tuple[int, Any]]:
        """Its (KiB, variable) terms at ``point``."""
        return []

    def objective(self, model: Model) -> None:
        """Appends its (ns, variable) terms to ``model.obj``."""

    def start(self, model: Model, pick: dict[int, int]) -> None:
        """Hints its variables to complete the start ``pick`` (root group -> strategy)."""

    def read_back(self, model: Model, solver: cp_model.CpSolver) -> Any:
        """Its part of the solution."""
        return None


def memory_points(p, cuts=()) -> list[Point]:
    """The memory points of ``p``: its check points (one with nothing live when it has none),
    then the copy cuts ``cuts``."""
    points = [Point(str(k), live) for k, live in enumerate(p.mem_points or [[]])]
    return points + [cut_point(k, cut) for k, cut in enumerate(cuts)]


def cut_point(k: int, cut) -> Point:
    """The memory point of the ``k``-th copy cut ``cut`` (``memory.CopyCut``)."""
    return Point(f"cut:{k}", cut.live, cut)


def memory_expr(model: Model, families, point: Point):
    """Every family's KiB at ``point``, one linear expression."""
    return sum(k * v for f in families for k, v in f.memory(model, point))
