"""The request: a traced graph and the caller's options, checked and resolved (mesh sizes,
hardware profile, cost model, budget, strategy pins and starts) in one place, ``make_request``,
into one ``Request`` (``autopar.options``) that the planner takes. ``autopar.plan``,
``@autoparallel``, ``compare`` and the pipeline's stage pricing all plan through ``plan_graph``."""
from __future__ import annotations

import dataclasses
import warnings

import cost_models
import ir
from autopar import distributed, strategies, validate
from autopar.mesh import axis_sizes, hardware_for
from autopar.options import PlannerOptions, Request, checks_enabled, deterministic_default
from autopar.plan import Plan
from autopar.planner import constraints, make_plan
from autopar.strategies.user import constraints_only


def plan_graph(graph: ir.Graph, mesh, *, trace_s: float = 0.0, **kwargs) -> Plan:
    """Plan an already traced graph (see ``autopar.plan``): the ``make_request`` of the
    arguments, planned with ``trace_s`` of its time limit already spent, the strategy's notes
    on the plan."""
    request = make_request(graph, mesh, **kwargs)
    if request.notes:
        warnings.warn(f"autopar: strategy {request.options.strategy!r} cannot place every "
                      f"parameter as it intends (plan.summary() lists them):\n  "
                      + "\n  ".join(request.notes), UserWarning, stacklevel=3)
    plan = make_plan(request, trace_s=trace_s)
    return dataclasses.replace(plan, notes=request.notes) if request.notes else plan


def make_request(graph: ir.Graph, mesh, *, hardware=None, memory_budget=None, strategy="auto",
                 time_limit_s: float = 30.0, deterministic: bool | None = None,
                 kernels: str = "never", host_inputs: bool = True,
                 seed_plans: tuple[Plan, ...] = (), user_layout=None,
                 memory_decisions=validate.MEMORY_DECISIONS) -> Request:
    """The one ``Request`` of a call (see ``autopar.plan``), its arguments checked;
    ``host_inputs=False``: no input is fed from the host (``PlannerOptions.host_inputs``);
    ``seed_plans``: plans of this graph auto is held against (``PlannerOptions.seed_plans``);
    ``user_layout``: the layout the arguments are committed to (``strategies.user.from_arrays``),
    the strategy ``"user"`` and one more start auto is held against."""
    sizes = axis_sizes(mesh)
    hw = hardware_for(hardware, mesh)
    budget = validate.memory_budget(memory_budget)
    time_limit_s = validate.time_limit(time_limit_s)
    cm = cost_models.CostModel(hw, sizes, device_nodes=distributed.device_nodes(mesh))
    name, strat = validate.strategy(strategy)
    if name == "user" and user_layout is not None:
        strat = user_layout
    if hasattr(strat, "bind"):   # hand-written: find parameters and their roles in this graph
        strat = strat.bind(graph, sizes)
    fixed = (validate.fixed_layouts(strat.fix_inputs(graph, sizes), graph, sizes, name)
             if strat is not None else None)
    op_filter = getattr(strat, "allows", None)
    budget = hw.memory_bytes if memory_budget is None else budget
    starts = handwritten_starts() if strat is None else ()
    if strat is None and user_layout is None and constraints.has_constraints(graph):
        user_layout = constraints_only()    # the step's own constraints: auto's hint
    if strat is None and user_layout is not None:
        starts = (*starts, user_layout)
    if checks_enabled():
        ir.verify(graph)
    opts = PlannerOptions(strategy=name, memory_budget=budget, time_limit_s=time_limit_s,
                          fixed_inputs=fixed, op_filter=op_filter, starts=tuple(starts),
                          keep_constraints=getattr(strat, "keeps_constraints", False),
                          deterministic=resolve_deterministic(deterministic),
                          kernels=validate.kernels(kernels, hw, mesh), host_inputs=host_inputs,
                          recompute="recompute" in validate.memory_decisions(memory_decisions),
                          offload="offload" in validate.memory_decisions(memory_decisions),
                          seed_plans=tuple(seed_plans) if strat is None else ())
    return Request(graph, sizes, cm, opts, tuple(getattr(strat, "notes", ())))


# Hand-written strategies auto is held against (planner._seeds): each one's own plan is solved
# on auto's problem, the cheapest that fits starts the ILP, and auto returns nothing slower. One
# that a mesh or step cannot take is skipped; fsdp pins what zero3 does (solved once).
STARTS = ("dp", "zero1", "zero2", "zero3", "fsdp", "megatron", "megatron_sp", "fsdp_tp", "ep")


def handwritten_starts() -> list:
    return [strategies.get(name) for name in STARTS]


def resolve_deterministic(value) -> bool:
    return deterministic_default() if value is None else validate.flag("deterministic", value)
