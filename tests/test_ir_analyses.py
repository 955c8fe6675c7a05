"""ir.analyses: what is computed about a graph is computed once, kept with that graph alone, and
handed to a derived graph only where the pass that derives it says so."""
from __future__ import annotations

import dataclasses
import functools

import pytest

import ir
from autopar.models import gpt
from autopar.planner import problem
from autopar.strategies import logical
from ir import fold, fusion, layers
from ir import graph as graph_module

CFG = gpt.GPTConfig(layers=8, d_model=16, heads=2, d_ff=32, seq=8, vocab=32)

# slot -> (module, the function that computes it)
COMPUTED = {"fusion": (fusion, "_fuse"), "roles": (layers, "_roles"),
            "node_graph": (layers, "_build_node_graph"), "fold": (fold, "_fold"),
            "fingerprint": (graph_module, "fingerprint")}
ASK = {"fusion": fusion.fuse, "roles": layers.roles, "node_graph": layers.node_graph,
       "fold": fold.fold, "fingerprint": ir.Graph.fingerprint}


@functools.cache
def _graph() -> ir.Graph:
    return ir.trace(*gpt.abstract(CFG, 2))


@pytest.fixture
def counted(monkeypatch):
    """Slot -> the graphs its analysis was computed for, in order."""
    calls: dict[str, list] = {name: [] for name in COMPUTED}
    for name, (module, fn) in COMPUTED.items():
        real = getattr(module, fn)

        def spy(graph, *args, _real=real, _name=name):
            calls[_name].append(graph)
            return _real(graph, *args)

        monkeypatch.setattr(module, fn, spy)
    return calls


@pytest.mark.parametrize("slot", sorted(COMPUTED))
def test_each_analysis_is_computed_once_per_graph(counted, slot):
    g = dataclasses.replace(_graph())        # fresh analyses, none computed yet
    first = ASK[slot](g)
    assert ASK[slot](g) is first and getattr(g.analyses, slot) is first
    assert counted[slot] == [g], f"expected one {slot} of the graph, got {len(counted[slot])}"


def test_replace_gives_fresh_analyses(counted):
    g = dataclasses.replace(_graph())
    fusion.fuse(g)
    h = dataclasses.replace(g)
    assert h == g and h.analyses is not g.analyses and not h.analyses.computed("fusion")
    assert fusion.fuse(h) is not fusion.fuse(g)
    assert counted["fusion"] == [g, h]
    assert problem.facts(h) is not problem.facts(g) and problem.facts(g) is problem.facts(g)
    assert logical.facts(h) is not logical.facts(g)


def test_passes_carry_only_what_they_vouch_for(counted):
    """``find_layers`` hands on the node graph (ids unchanged), ``fold`` the full graph's roles;
    nothing else crosses to a derived graph."""
    g = dataclasses.replace(_graph())
    nodes = layers.node_graph(g)
    relabelled = layers._assign(g, g.layers)
    assert relabelled.analyses.node_graph is nodes and not relabelled.analyses.computed("roles")
    f = fold.fold(g)
    assert f is not None and f.graph.analyses.computed("roles")
    assert not f.graph.analyses.computed("fusion") and not f.graph.analyses.computed("fold")
    full = layers.roles(g)
    assert all(layers.roles(f.graph).op[op.id] == full.op[op.id] for op in f.graph.ops)


def test_carry_refuses_unknown_or_computed_slots():
    g = dataclasses.replace(_graph())
    with pytest.raises(ValueError, match="not one of"):
        g.analyses.carry(fusion=None)
    layers.roles(g)
    with pytest.raises(ValueError, match="already computed"):
        g.analyses.carry(roles=None)


def test_upper_layers_attach_one_object_per_graph():
    g = dataclasses.replace(_graph())
    assert problem.output_pairs(g) is problem.facts(g).output_pairs
    assert logical.annotate(g) is logical.annotate(g)
