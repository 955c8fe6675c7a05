"""XLA's all-reduce combiner in the plan's cost (``autopar.planner.combine``)."""
from __future__ import annotations

import re

import jax.numpy as jnp
import pytest

import autopar
import cost_models
import ir
from autopar.models import gpt
from autopar.planner import combine


def _graph():
    # two independent products, then one that reads both
    return ir.trace(lambda x, y: (x * 2.0) + (y * 3.0), jnp.ones((8,)), jnp.ones((8,)))


def test_independent_reduces_share_one_launch_dependent_ones_do_not() -> None:
    g = _graph()
    mul_x, mul_y, add = (op.id for op in g.ops)
    assert combine.launch_refund_s(g, [(mul_x, ("data",)), (mul_y, ("data",))], 1.0) == 1.0
    # the add reads what both reduce: a later level, its own launch
    assert combine.launch_refund_s(g, [(mul_x, ("data",)), (add, ("data",))], 1.0) == 0.0
    # different groups are never merged; no launch cost, nothing to refund
    assert combine.launch_refund_s(g, [(mul_x, ("data",)), (mul_y, ("model",))], 1.0) == 0.0
    assert combine.launch_refund_s(g, [(mul_x, ("data",)), (mul_y, ("data",))], 0.0) == 0.0


def test_gpu_profiles_pay_no_collective_launch() -> None:
    for name in ("a100", "h100", "h200"):
        assert cost_models.hardware(name).collective_launch_s == 0.0


@pytest.fixture(scope="module")
def dp_step():
    cfg = gpt.GPTConfig(vocab=128, seq=16, d_model=32, heads=2, d_ff=64, layers=1)
    fn, state, batch = gpt.concrete(cfg, 16)
    step = autopar.autoparallel(fn, mesh={"data": 8}, hardware="cpu", strategy="dp",
                                time_limit_s=60)
    return step, step.lower(state, batch).compile()


def test_data_parallel_launches_as_many_all_reduces_as_xla_runs(dp_step) -> None:
    step, compiled = dp_step
    plan = step.plan
    reduces = [c for c in plan.collectives if c.kind == "all-reduce"]
    hlo = [ln for ln in compiled.as_text().splitlines()
           if re.search(r"= .*\ball-reduce(-start)?\(", ln)]
    one = cost_models.CostModel("cpu", {"data": 8}).hw.collective_launch_s
    refund = len(reduces) - sum(1 for _ in hlo)
    assert len(reduces) > len(hlo) >= 1       # XLA merged the gradients' all-reduces
    by_kind = dict(plan.cost.comm_by_kind)
    unmerged = sum(c.time_s for c in reduces)
    assert by_kind["all-reduce"] == pytest.approx(unmerged - refund * one, rel=0.05)
