"""Deeper unrolled models give the solver the same problem: layers tie, repeated edges merge."""
from __future__ import annotations

import dataclasses

import pytest

import cost_models
import ir
from autopar.models import gpt, hf
from autopar.planner import descent, problem

MESH = {"data": 2, "model": 4}
CM = cost_models.CostModel(cost_models.hardware("h100"), MESH)


def _size(graph: ir.Graph) -> tuple[int, int, int]:
    p = problem.build(graph, MESH, CM)
    return p.num_decisions, len(p.merged_edges()), problem.flow_pairs(p)


def _gpt(layers: int) -> ir.Graph:
    cfg = gpt.GPTConfig(layers=layers, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)
    return ir.trace(*gpt.abstract(cfg, 8))


def test_autopar_gpt_problem_does_not_grow_with_depth():
    four, eight = _gpt(4), _gpt(8)
    assert len(eight.ops) > 1.8 * len(four.ops)
    assert _size(four) == _size(eight)


def test_hf_gpt2_problem_does_not_grow_with_depth():
    pytest.importorskip("transformers")
    graphs = [ir.trace(*hf.abstract("gpt2", hf.tiny("gpt2", layers=n), 8)) for n in (3, 6)]
    assert _size(graphs[0]) == _size(graphs[1])


def test_tied_groups_cost_what_their_layers_cost():
    """Tying shares decisions only: every group keeps its own costs, so the objective of a plan
    is the same whether read per group or per root, and the merged edge sets the solver sees
    price every plan's resharding as the raw edge sets do (each distinct move once)."""
    p = problem.build(_gpt(4), MESH, CM)
    assert p.ties, "a 4-layer GPT has tied layers"
    total = sum(float(g.compute_s[0] + g.comm_s[0]) for g in p.groups)
    assert sum(float(c[0]) for c in p.root_costs().values()) == pytest.approx(total)
    assert len(p.merged_edges()) < len(p.edges) / 2
    for choice in (descent.descend(p, CM), {g.id: (g.id * 7) % g.n for g in p.groups}):
        choice = {g.id: choice[p.root(g.id)] for g in p.groups}    # tied groups agree
        raw = 0.0
        for es in p.edge_sets():
            have = p.groups[es[0].src].shard[es[0].value][choice[es[0].src]]
            for need in {e.need[choice[e.dst]] for e in es} - {have}:
                raw += es[0].mult * p.reshard_s(es[0].value, have, need)
        assert raw > 0 and p.transition_s(choice) == pytest.approx(raw)


def test_scan_and_unrolled_gpt_share_a_plan_shape():
    """The scanned and the unrolled model pick layouts from problems of similar size."""
    base = gpt.GPTConfig(layers=4, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)
    scan = ir.trace(*gpt.abstract(dataclasses.replace(base, scan=True), 8))
    unrolled, scanned = _size(_gpt(4)), _size(scan)
    assert unrolled[0] <= 2 * scanned[0], (unrolled, scanned)
