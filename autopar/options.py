"""The planner's options as one frozen object, passed down instead of a row of keyword arguments,
and the ``Request`` that carries them to the planner with the graph, mesh and cost model.

    opts = PlannerOptions(memory_budget=40e9, time_limit_s=10)
    plan = make_plan(Request(graph, mesh, cost_model, opts))

``autopar.request.make_request`` makes the request of a user's call, once, after checking it.

Environment variables are read here and nowhere else. They control debug output
(``AUTOPAR_CHECKS``) and, for test suites, reproducibility (``AUTOPAR_DETERMINISTIC``).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from autopar.sharding import Sharding

if TYPE_CHECKING:
    from cost_models import CostModel, Hardware
    from ir import Graph


def deterministic_default() -> bool:
    """``AUTOPAR_DETERMINISTIC=1`` makes ``deterministic=True`` the default of ``autopar.plan``
    and ``autoparallel`` (planning stops on the solver's deterministic clock only): the test
    suite sets it so that its golden plans do not depend on how loaded the machine is."""
    return os.environ.get("AUTOPAR_DETERMINISTIC", "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """What a plan is asked to satisfy and how hard the solver may look.

    Attributes:
      strategy: the name the plan is labelled with (``"auto"`` or a hand-written strategy's).
      memory_budget: per-device bytes every plan must fit; ``None`` for no limit.
      time_limit_s: the wall-clock budget of the whole plan call (see ``planner.budget``);
        CP-SAT's deterministic limit too.
      deterministic: stop on CP-SAT's deterministic clock only, never on the wall clock, so the
        same inputs give the same plan under any load (the call may then run past the budget);
        default ``deterministic_default()``.
      fixed_inputs: input index -> layout the plan must use (a hand-written strategy's pins).
      op_filter: ``op_filter(op, strategy[, origins])`` returns False for op strategies a
        hand-written strategy rules out.
      keep_constraints: the step's own ``with_sharding_constraint`` calls are pinned to the
        layouts they ask for (the "user" strategy: the step as written); otherwise the plan
        chooses those values' layouts as any other's (``Plan.constraints`` says which it
        follows).
      hint: group id -> strategy index to start the solver from.
      starts: hand-written strategies auto is held against: each one's own plan is solved on
        auto's problem, the cheapest that fits the budget starts the solver, and nothing slower
        than it is returned (``planner._seeds``, ``planner._never_worse``).
      seed_plans: plans of the same graph to hold auto against as well (``compare``'s
        hand-written rows): a start of the same name is then not solved again.
      kernels: "auto" (the ILP weighs each fused kernel against XLA's ops), "always" (a kernel
        wherever the layouts allow one) or "never"; ``autopar.plan`` resolves its own "auto"
        to "auto" or "never" by the hardware (``autopar.validate.kernels``).
      host_inputs: inputs that are not carried state (a batch) arrive from the host every step,
        and each device pays for the bytes it receives (``planner.problem``); False: every input
        is already on the devices (a pipeline stage's sub-plans, whose parameters are the
        runtime's state and whose activations come from the previous stage).
      fold: plan an unrolled model's repeated layers on a graph with their middle copies
        removed (``ir.fold``) and map the plan back, when nothing pins inputs, filters ops,
        hints groups or chooses kernels; if that plan breaks ``memory_budget``, the full graph
        is planned. False: always the full graph.
      recompute: where no plan fits ``memory_budget``, plan the step again with its scanned
        layers' saved values recomputed in the backward pass (``planner.recompute``); only
        where no ``op_filter`` is bound to the traced graph's ops (auto, the user's layout).
      offload: where no plan fits ``memory_budget`` and the hardware profile has a host link,
        plan the step again with groups of its update-only state (an optimizer's moments) held
        in host memory between steps (``planner.offload``), beside the recomputation policies
        and, where neither fits alone, on top of each; the same restriction on ``op_filter``.
      explain_budget: a plan that cannot fit ``memory_budget`` seeks the smallest budget that
        fits, for its error's advice (``ilp.min_memory``: seconds of solves); False when the
        error is only a step of a search (``planner.recompute``'s first attempt).
    """

    strategy: str = "auto"
    memory_budget: float | None = None
    time_limit_s: float = 30.0
    fixed_inputs: Mapping[int, Sharding] | None = None
    op_filter: Callable[..., bool] | None = None
    keep_constraints: bool = False
    hint: Mapping[int, int] | None = None
    starts: tuple[Any, ...] = ()
    seed_plans: tuple[Any, ...] = ()
    deterministic: bool = dataclasses.field(default_factory=deterministic_default)
    kernels: str = "never"
    host_inputs: bool = True
    fold: bool = True
    recompute: bool = True
    offload: bool = True
    explain_budget: bool = True

    def replace(self, **changes: Any) -> PlannerOptions:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Request:
    """One planning request: what the planner is asked, resolved once at the boundary
    (``autopar.request.make_request``: mesh sizes, hardware, budget, strategy and options
    checked there), and nothing below re-derives it.

    Attributes:
      graph: the traced step.
      mesh: axis name -> size, in the mesh's order.
      cost_model: the hardware and the mesh (with its devices' nodes where the mesh is
        concrete) that every time is priced by.
      options: the rest (``PlannerOptions``), the memory budget among them.
      notes: what the boundary found the plan should report (a strategy that cannot place a
        parameter as it intends); the planner does not read them.
    """

    graph: Graph
    mesh: Mapping[str, int]
    cost_model: CostModel
    options: PlannerOptions = dataclasses.field(default_factory=PlannerOptions)
    notes: tuple[str, ...] = ()

    @property
    def hardware(self) -> Hardware:
        return self.cost_model.hw

    @property
    def budget(self) -> float | None:
        """Per-device bytes every plan must fit (``PlannerOptions.memory_budget``)."""
        return self.options.memory_budget


def checks_enabled() -> bool:
    """``AUTOPAR_CHECKS=1`` (the tests set it) runs ``ir.verify`` between planner stages."""
    return os.environ.get("AUTOPAR_CHECKS", "") not in ("", "0")
