"""ir.layers: repeated blocks of unrolled and scanned models."""
from __future__ import annotations

import dataclasses

import pytest

import ir
from autopar.models import gpt
from ir.layers import block_key

CFG = gpt.GPTConfig(layers=4, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_gpt_has_four_equal_layers(remat):
    g = ir.trace(*gpt.abstract(dataclasses.replace(CFG, remat=remat), 2))
    blocks = [layer for layer in g.layers if layer.name.startswith("GPT/layer_")]
    assert [b.name for b in blocks] == [f"GPT/layer_{i}" for i in range(4)]
    assert len({b.signature for b in blocks}) == 1 and len({len(b.op_ids) for b in blocks}) == 1
    for b in blocks:  # forward and backward ops of the block, layer index set on each op
        names = {g.op(i).name.split("/")[0] for i in b.op_ids}
        assert {"jvp(GPT)", "transpose(jvp(GPT))"} <= names
        assert all(g.op(i).layer == b.index for i in b.op_ids)
    first, second = blocks[0], blocks[1]
    assert [g.op(i).prim for i in first.op_ids] == [g.op(i).prim for i in second.op_ids]


def test_scan_gpt_layers():
    g = ir.trace(*gpt.abstract(dataclasses.replace(CFG, scan=True), 2))
    assert [layer.kind for layer in g.layers] == ["scan", "scan"]
    assert all(layer.repeats == 4 for layer in g.layers)
    fwd = g.layers[0]
    scan_op = g.op(fwd.op_ids[0])
    assert scan_op.prim == "scan" and len(fwd.op_ids) == 1 + len(scan_op.regions[0].ops)
    assert g.op(fwd.op_ids[1]).layer == fwd.index


@pytest.mark.parametrize("name, key", [
    ("transpose(jvp(GPT))/layer_3/mlp", ("GPT/layer", 3)),
    ("jvp(MLP)/Dense_1", ("MLP/Dense", 1)),
    ("transpose(jvp(GPT))/jvp(GPT)/rematted_computation/layer_3/ln1", ("GPT/layer", 3)),
    ("jvp(GPT)/ln_f", None),
    ("", None),
])
def test_block_key(name, key):
    assert block_key(name) == key
