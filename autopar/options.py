"""The planner's options as one frozen object, passed down instead of a row of keyword arguments.

    opts = PlannerOptions(memory_budget=40e9, time_limit_s=10)
    plan = make_plan(graph, mesh, cost_model, opts)

Environment variables are read here and nowhere else; they control debug output only.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from autopar.sharding import Sharding


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """What a plan is asked to satisfy and how hard the solver may look.

    Attributes:
      strategy: the name the plan is labelled with (``"auto"`` or a hand-written strategy's).
      memory_budget: per-device bytes every plan must fit; ``None`` for no limit.
      time_limit_s: the solver's deterministic time limit.
      fixed_inputs: input index -> layout the plan must use (a hand-written strategy's pins).
      op_filter: ``op_filter(op, strategy[, origins])`` returns False for op strategies a
        hand-written strategy rules out.
      hint: group id -> strategy index to start the solver from.
      starts: hand-written strategies whose descent solutions seed the solver (the cheapest one
        that fits the budget is the start).
    """

    strategy: str = "auto"
    memory_budget: float | None = None
    time_limit_s: float = 30.0
    fixed_inputs: Mapping[int, Sharding] | None = None
    op_filter: Callable[..., bool] | None = None
    hint: Mapping[int, int] | None = None
    starts: tuple[Any, ...] = ()

    def replace(self, **changes: Any) -> PlannerOptions:
        return dataclasses.replace(self, **changes)


def checks_enabled() -> bool:
    """``AUTOPAR_CHECKS=1`` (the tests set it) runs ``ir.verify`` between planner stages."""
    return os.environ.get("AUTOPAR_CHECKS", "") not in ("", "0")
