"""XLA's all-reduce combiner in the plan's cost (``autopar.planner.combine``)."""
from __future__ import annotations

import re

import jax
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
    assert combine.launch_refund_s(g, [(mul_x, ("data",), 1), (mul_y, ("data",), 1)], 1.0) == 1.0
    # the add reads what both reduce: a later level, its own launch
    assert combine.launch_refund_s(g, [(mul_x, ("data",), 1), (add, ("data",), 1)], 1.0) == 0.0
    # different groups are never merged; no launch cost, nothing to refund
    assert combine.launch_refund_s(g, [(mul_x, ("data",), 1), (mul_y, ("model",), 1)],
                                   1.0) == 0.0
    assert combine.launch_refund_s(g, [(mul_x, ("data",), 1), (mul_y, ("data",), 1)], 0.0) == 0.0
    # a count that is not its region's (a folded layer standing for several) is left alone
    assert combine.launch_refund_s(g, [(mul_x, ("data",), 3), (mul_y, ("data",), 3)], 1.0) == 0.0


def test_a_scan_body_merges_its_reduces_once_per_iteration() -> None:
    """XLA's combiner runs on loop bodies too: two independent all-reduces in a 5-trip scan
    body save 5 launches."""
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + (x * 2.0).sum() + (x * 3.0).sum(), None), 0.0,
                            xs)[0]

    g = ir.trace(f, jnp.ones((5, 8)))
    scan = next(op for op in g.ops if op.prim == "scan")
    muls = [op.id for op in scan.regions[0].ops if op.prim == "mul"]
    assert combine.launch_refund_s(g, [(m, ("data",), 5) for m in muls], 1.0) == 5.0


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


def test_gradient_accumulation_launches_as_many_all_reduces_as_xla_runs() -> None:
    """A gradient-accumulation scan planned data-parallel all-reduces each microbatch's
    gradients in the loop body; XLA merges them into one all-reduce per iteration, and the
    plan's all-reduce time counts the merged launches only."""
    from autopar.models import zoo

    cfg = zoo.Config(layers=1, width=32, ff=64, accum=2, batch=8)
    fn, params, opt, batch = zoo.nnx_lm(cfg)
    step = autopar.autoparallel(fn, mesh={"data": 8}, hardware="cpu", strategy="dp",
                                time_limit_s=60)
    text = step.lower(params, opt, batch).compile().as_text()
    plan = step.plan
    body = [c for c in plan.collectives if c.kind == "all-reduce" and c.count == cfg.accum]
    merged = sum(1 for ln in text.splitlines() if re.search(r"= .*\ball-reduce(-start)?\(", ln)
                 and "channel_id" in ln)
    assert len(body) > 1 and merged < len(body)
    one = cost_models.CostModel("cpu", {"data": 8}).hw.collective_launch_s
    top = [c for c in plan.collectives if c.kind == "all-reduce" and c.count == 1]
    unmerged = sum(c.time_s for c in body + top)
    saved = unmerged - dict(plan.cost.comm_by_kind)["all-reduce"]
    assert saved >= (len(body) - 1) * cfg.accum * one * 0.95
