"""Deeper unrolled models give the solver the same problem: layers tie, repeated edges merge."""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np
import pytest

import cost_models
import ir
from autopar.api import plan_graph
from autopar.models import gpt, hf
from autopar.planner import descent, memory, problem
from autopar.sharding import shard_factor

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


def test_hf_gpt2_problem_does_not_grow_with_depth(hf_graphs):
    assert _size(hf_graphs[4]) == _size(hf_graphs[8])


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


# -- the shortcuts that keep planning linear in depth change no plan --------------------------
def _hbm_per_read(graph, fusion, mesh, op, st, io=None):
    """``problem.op_hbm_bytes`` as it was: every read of a copied op priced one by one."""
    if op.regions:
        return _FAST_HBM(graph, fusion, mesh, op, st)

    def per_device(v, layout):
        return graph.values[v].nbytes / (shard_factor(layout, mesh) if layout else 1)

    total = 0.0
    for v in fusion.reads.get(op.id, ()) + 2 * fusion.copies.get(op.id, ()):
        k = op.ins.index(v)
        total += per_device(v, st.ins[k] if k < len(st.ins) else None)
    for v in fusion.writes.get(op.id, ()):
        total += per_device(v, st.outs[op.outs.index(v)])
    return total


def _pooled_one_by_one(spans, slots):
    """``memory._pooled`` as it was: first fit testing each result buffer in turn (a slot
    ``busy`` up to a position holds a donated argument until then)."""
    taken = [[(0, busy)] if busy >= 0 else [] for _, _, busy in slots]
    pooled = []
    for a, b, size in sorted(spans, key=lambda s: (-s[2], s[0])):
        k = next((k for k, (cap, written, _) in enumerate(slots)
                  if cap >= size and b < written and _free(taken[k], a, b)), None)
        if k is None:
            pooled.append((a, b, size))
        else:
            bisect.insort(taken[k], (a, b))
    return pooled


def _free(occupied, a, b):
    """No interval of the sorted, disjoint ``occupied`` meets ``[a, b]``."""
    i = bisect.bisect_left(occupied, (a, a))
    return (i == len(occupied) or occupied[i][0] > b) and (i == 0 or occupied[i - 1][1] < a)


_FAST_HBM = problem.op_hbm_bytes


@pytest.fixture(scope="module")
def hf_graphs():
    pytest.importorskip("transformers")
    return {n: ir.trace(*hf.abstract("gpt2", hf.tiny("gpt2", layers=n), 8)) for n in (4, 8)}


def _plan(graph):
    return plan_graph(graph, MESH, hardware="h100", deterministic=True)


@pytest.fixture(scope="module")
def hf_plans(hf_graphs):
    return {n: _plan(g) for n, g in hf_graphs.items()}


def test_depth_shortcuts_keep_the_plan(hf_graphs, hf_plans, monkeypatch):
    """Counted reads and the all-buffers first fit plan an unrolled GPT-2 exactly as the
    one-by-one versions did: same decisions, same predicted time, memory and traffic."""
    fast = hf_plans[4]
    monkeypatch.setattr(problem, "op_hbm_bytes", _hbm_per_read)
    monkeypatch.setattr(memory, "_pooled", _pooled_one_by_one)
    slow = _plan(hf_graphs[4])
    assert fast.choices == slow.choices and fast.pins == slow.pins
    for field in ("step_time_s", "compute_s", "comm_s", "transition_s", "peak_memory_bytes",
                  "hbm_bytes"):
        a, b = getattr(fast.cost, field), getattr(slow.cost, field)
        assert a == pytest.approx(b, rel=1e-9, abs=0.0), field
    assert fast.cost.hbm_bytes > 0 and fast.cost.peak_memory_bytes > 0


def test_a_graph_is_fused_once_for_all_its_plans(hf_graphs, hf_plans, monkeypatch):
    """A second plan of one graph (``compare`` plans it once per strategy) reuses the fusion,
    schedule and kernel bytes kept with its analyses, and plans exactly as a fresh copy of the
    graph, which computes them again."""
    from ir import fusion

    g, computed = hf_graphs[4], []
    real = fusion._fuse
    monkeypatch.setattr(fusion, "_fuse", lambda graph: computed.append(graph) or real(graph))
    again = _plan(g)                   # hf_plans planned g already
    copy = dataclasses.replace(g)      # the same graph without its caches
    fresh = _plan(copy)
    assert computed == [copy]
    assert problem.facts(g)._schedule[0] is fusion.fuse(g)
    for plan in (again, fresh):
        assert plan.choices == hf_plans[4].choices and plan.pins == hf_plans[4].pins
        assert plan.cost == hf_plans[4].cost


def test_hf_gpt2_rules_and_costs_are_evaluated_once_per_role(hf_graphs, monkeypatch):
    """Building the problem asks the rules and prices strategies as often for 8 unrolled layers
    as for 4: a repeated layer's ops reuse the first layer's results (counts, not time)."""
    calls = {"rule": 0, "costs": 0}
    rule_for, add_costs = problem.rules.rule_for, problem._Builder.add_costs

    def counted_rule(*a, **k):
        calls["rule"] += 1
        return rule_for(*a, **k)

    def counted_costs(*a, **k):
        calls["costs"] += 1
        return add_costs(*a, **k)

    monkeypatch.setattr(problem.rules, "rule_for", counted_rule)
    monkeypatch.setattr(problem._Builder, "add_costs", counted_costs)
    seen = []
    for n in (4, 8):
        calls.update(rule=0, costs=0)
        problem.build(hf_graphs[n], MESH, CM)
        seen.append(dict(calls))
    assert seen[0] == seen[1] and seen[0]["rule"] > 0 and seen[0]["costs"] > 0, seen


def test_tracing_and_planning_restore_the_cycle_collector():
    """Tracing and planning pause Python's cycle collector (its full collections walk the traced
    program) while they run, and leave it as they found it, on or off."""
    import gc

    cfg = gpt.GPTConfig(layers=1, d_model=16, heads=2, d_ff=32, seq=8, vocab=32)
    fn, state, batch = gpt.abstract(cfg, 8)
    seen = []

    def step(state, batch):
        seen.append(gc.isenabled())    # runs while jax traces it
        return fn(state, batch)

    was = gc.isenabled()
    try:
        for on in (True, False):
            (gc.enable if on else gc.disable)()
            graph = ir.trace(step, state, batch)
            assert gc.isenabled() is on and seen[-1] is False
            _plan(graph)
            assert gc.isenabled() is on
    finally:
        (gc.enable if was else gc.disable)()


def test_hf_gpt2_ilp_does_not_grow_with_depth(hf_graphs, hf_plans):
    """The solver's model for 8 unrolled layers is the one for 4: the same decision groups, and
    as many variables and constraints to within the few a cost-ranked candidate makes (the
    candidate rounds pick each group's cheapest strategies, and a layer's cost against the
    embedding's or head's changes with depth), where growing with depth would double them."""
    four, eight = (hf_plans[n].solver for n in (4, 8))
    assert len(hf_graphs[8].ops) > 1.8 * len(hf_graphs[4].ops)
    assert four.num_groups == eight.num_groups
    assert four.num_vars > 0
    assert abs(eight.num_vars - four.num_vars) <= 0.01 * four.num_vars
    assert abs(eight.num_constraints - four.num_constraints) <= 0.01 * four.num_constraints


def test_first_fit_matches_one_by_one():
    """The bitset first fit (``planner.first_fit``) places every temporary where the one-by-one
    search did, on nested, disjoint and gapped intervals, with buffers too small for some
    temporaries and temporaries that touch the schedule's ends."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        spans = []
        for _ in range(int(rng.integers(0, 120))):
            a = int(rng.integers(0, 200))
            spans.append((a, a + int(rng.integers(0, 60)), float(rng.choice([1, 2, 4, 8]))))
        slots = sorted(((float(rng.choice([1, 2, 4, 8])), int(rng.integers(0, 300)),
                         int(rng.choice([-1, int(rng.integers(0, 150))])))
                        for _ in range(int(rng.integers(0, 30)))), key=lambda s: -s[0])
        assert memory._pooled(spans, slots) == _pooled_one_by_one(spans, slots)


def test_hf_gpt2_repeated_work_is_done_once_per_case(hf_graphs, monkeypatch):
    """Planning 8 unrolled layers sums as many distinct lists of group costs, prices collectives
    and maps hand-written layouts as often as planning 4 (counts, not time): the build sums a
    repeated layer's groups once (``_Builder.add_pending``; groups that run through every layer,
    like the residual stream's, are one list at any depth), assembly memoises collective prices
    and ``HandWritten.fix_inputs`` maps each (names, shape) once. On the full graphs: folding
    (``ir.fold``, which plans 8 layers on a 4-copy graph) is turned off."""
    import cost_models.model
    from autopar import planner, strategies

    monkeypatch.setattr(planner, "fold", lambda graph: None)

    calls = {"collective": 0, "layouts": 0}
    for name, (owner, attr) in {"collective": (cost_models.model.CostModel, "collective_time_s"),
                                "layouts": (strategies, "_normalize")}.items():
        original = getattr(owner, attr)

        def counted(*a, _original=original, _name=name, **k):
            calls[_name] += 1
            return _original(*a, **k)

        monkeypatch.setattr(owner, attr, counted)
    add_pending = problem._Builder.add_pending

    def summed(self):
        calls["sums"] = add_pending(self)
        return calls["sums"]

    monkeypatch.setattr(problem._Builder, "add_pending", summed)
    seen = []
    for n in (4, 8):
        calls.update(sums=0, collective=0, layouts=0)
        _plan(hf_graphs[n])
        seen.append(dict(calls))
    assert seen[0] == seen[1] and min(seen[0].values()) > 0, seen


def test_descent_masks_match_one_mask_per_group():
    """``descent._masked`` (counts per distinct allowed set) gives the arrays one mask per group
    gave, bit for bit: tied groups sharing a set, sets that differ within a root, costs that
    ``big`` absorbs and costs it does not (huge, infinite)."""
    class _Tied:
        ties = {1: 0, 2: 0, 4: 3}

        def root(self, g):
            return self.ties.get(g, g)

    shared = {0, 2}
    allowed = {0: shared, 1: shared, 2: {1, 2}, 3: {0}, 4: {0}}
    unary = {0: np.array([1e-3, 2.5, 0.0, 7.0]), 3: np.array([1e14, np.inf, 3e29]),
             5: np.array([1.0])}
    expected = dict(unary)
    for g, ok in allowed.items():
        r = _Tied().root(g)
        mask = np.full(len(expected[r]), 1e30)
        mask[list(ok)] = 0.0
        expected[r] = expected[r] + mask
    got = descent._masked(_Tied(), dict(unary), allowed)
    assert got.keys() == expected.keys()
    for r in expected:
        assert np.array_equal(got[r], expected[r]), (r, got[r], expected[r])
    assert got[5] is unary[5]     # a root no set restricts keeps its (memoised) array


def test_hf_gpt2_start_restrictions_are_one_set_per_role(hf_graphs):
    """A hand-written start's input restrictions (``planner._allowed``) give the inputs of
    repeated layers one shared set per (strategies, layout), so ``descent._masked`` masks as
    often for 8 unrolled layers as for 4 (counts, not time)."""
    from autopar import planner, strategies

    seen = []
    for n in (4, 8):
        p = problem.build(hf_graphs[n], MESH, CM)
        strat = strategies.get("fsdp_tp").bind(hf_graphs[n], MESH)
        allowed = planner._allowed(p, strat.fix_inputs(hf_graphs[n], MESH))
        seen.append((len(allowed), len({(p.root(g), id(ok)) for g, ok in allowed.items()})))
    (entries4, masks4), (entries8, masks8) = seen
    assert entries8 > entries4 and masks8 == masks4 < entries4, seen


def test_memory_of_sums_each_group_in_order(hf_graphs):
    """``ilp.memory_of`` (numpy gathers) is, bit for bit, the per-group sum it replaced."""
    from autopar.planner import ilp

    p = problem.build(hf_graphs[4], MESH, CM)
    base, points = ilp._memory_tables(p)
    rng = np.random.default_rng(0)
    for _ in range(5):
        choice = tuple(int(rng.integers(g.n)) for g in p.groups)

        def total(values, choice=choice):
            out: dict[int, np.ndarray] = {}
            for v in values:
                g = p.group_of_value.get(v)
                if g is not None:
                    b = problem.value_bytes(p, v)
                    out[g] = out[g] + b if g in out else b
            return sum(float(arr[choice[g]]) for g, arr in out.items())

        want = total(p.const_values) + max((total(live) for live in p.mem_points), default=0.0)
        assert ilp.memory_of(p, choice) == want


def test_memory_points_match_one_slice_per_interval(hf_graphs):
    """``problem._memory_points`` (one prefix sum over all temporaries) picks the check points
    and live sets that adding each temporary's bytes to its schedule slice picked."""
    g = hf_graphs[4]
    fusion = problem.fuse(g)
    intervals, inner = schedule = (problem.temporaries(g, fusion), problem.body_peaks(g, fusion))
    live = np.zeros(len(g.ops) + 1)
    for v, a, b in intervals:
        live[a: b + 1] += g.values[v].nbytes
    for n in (1, 6, 50):
        points = sorted(np.argsort(-live, kind="stable")[:n])
        want = [[v for v, a, b in intervals if a <= t <= b] for t in points]
        assert problem._memory_points(g, n, schedule) == want
