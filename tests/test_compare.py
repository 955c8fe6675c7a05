"""autopar.compare: every strategy planned and measured in one call; failures are rows."""
from __future__ import annotations

import pytest
from test_strategies import CFG, GPT_STRATEGIES, small_gpt_comparison

import autopar
from autopar.models import gpt


def test_every_strategy_planned_and_measured():
    *_, cmp = small_gpt_comparison()
    assert [r.strategy for r in cmp.rows] == list(GPT_STRATEGIES) + ["auto", "no_such_strategy"]
    for r in cmp.rows[:-1]:
        assert r.ok, f"{r.strategy}: {r.error}"
        assert r.predicted_step_s > 0 and r.predicted_peak_bytes > 0
        assert r.measured_step_s > 0 and r.measured_peak_bytes > 0
        assert r.collectives == r.plan.collective_counts()
    assert cmp.mesh == {"data": 2, "model": 4} and cmp.hardware == "h100"


def test_failed_strategy_is_a_row():
    *_, cmp = small_gpt_comparison()
    bad = cmp["no_such_strategy"]
    assert not bad.ok and "unknown strategy" in bad.error and bad.predicted_step_s is None
    assert "error: ShardingError: unknown strategy" in str(cmp)


def test_auto_starts_from_the_best_handwritten_plan():
    *_, cmp = small_gpt_comparison()
    hand = min(cmp[n].predicted_step_s for n in GPT_STRATEGIES)
    assert cmp["auto"].predicted_step_s <= hand * (1 + 1e-9)
    assert cmp.best().strategy == "auto" or cmp.best().predicted_step_s == hand
    assert cmp.best("measured").measured_step_s == min(r.measured_step_s for r in cmp.rows
                                                       if r.ok)


def test_text_and_html_tables():
    *_, cmp = small_gpt_comparison()
    text = str(cmp)
    assert text.splitlines()[1].split()[:3] == ["strategy", "pred", "step"]
    for name in GPT_STRATEGIES:
        assert any(line.startswith(name + " ") for line in text.splitlines()), text
    page = cmp._repr_html_()
    assert page.count("<tr>") == len(cmp.rows) + 1 and "megatron_sp" in page


def test_impossible_memory_budget_is_an_error_row(capsys):
    step, state, batch = gpt.abstract(CFG, 8)
    cmp = autopar.compare(step, state, batch, mesh={"data": 2, "model": 4}, hardware="h100",
                          strategies=("dp",), memory_budget=1024, time_limit_s=2)
    (row,) = cmp.rows
    assert not row.ok and "memory budget" in row.error
    assert row.measured_step_s is None
    assert "autopar.compare: planned dp" in capsys.readouterr().err
    with pytest.raises(autopar.PlanError, match="no strategy"):
        cmp.best()
