"""ir.printer views and ir.verify."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import ir
from autopar.models import gpt

CFG = gpt.GPTConfig(layers=2, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)


@pytest.fixture(scope="module")
def graph():
    return ir.trace(*gpt.abstract(dataclasses.replace(CFG, scan=True), 2))


def test_summary(graph):
    s = graph.summary()
    assert "dot_general" in s and "total flops" in s and "scan x2" in s and "input bytes" in s


def test_listing(graph):
    text = str(graph)
    assert "dot_general(%" in text and "@ gpt.py:" in text and "region 0" in text
    assert "cut after 200 lines" in text and len(text.splitlines()) < 210


def test_to_networkx(graph):
    nxg = graph.to_networkx()
    assert nxg.number_of_nodes() == len(graph.ops)
    _, _, data = next(iter(nxg.edges(data=True)))
    assert {"value", "shape", "bytes"} <= set(data)


def test_verify_accepts_traced_graph(graph):
    assert ir.verify(graph) is graph


def _small():
    return ir.trace(lambda x: jnp.tanh(x @ x) * 2.0, jax.ShapeDtypeStruct((4, 4), jnp.float32))


def test_verify_catches_use_before_def():
    g = _small()
    ops = list(g.ops)
    ops[0], ops[1] = ops[1], ops[0]
    with pytest.raises(ir.IRError, match="used before it is defined") as err:
        ir.verify(dataclasses.replace(g, ops=tuple(ops)))
    assert ">>" in str(err.value) and len(str(err.value).splitlines()) < 30


def test_verify_catches_duplicate_ids():
    g = _small()
    bad = dataclasses.replace(g.ops[1], id=g.ops[0].id)
    with pytest.raises(ir.IRError, match="used twice"):
        ir.verify(dataclasses.replace(g, ops=(g.ops[0], bad) + g.ops[2:]))


def test_verify_catches_broken_region(graph):
    i, scan = next((i, op) for i, op in enumerate(graph.ops) if op.prim == "scan")
    region = dataclasses.replace(scan.regions[0], outputs=(10**6,))
    ops = list(graph.ops)
    ops[i] = dataclasses.replace(scan, regions=(region,))
    with pytest.raises(ir.IRError, match="region outputs"):
        ir.verify(dataclasses.replace(graph, ops=tuple(ops)))
