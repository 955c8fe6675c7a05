"""ir.trace: structure, costs against XLA, paths, scaling, and unknown primitives."""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import ir
from autopar.models import convnet, gpt, mlp, moe, nnx_mlp

SMALL = gpt.GPTConfig(layers=2, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)


def xla_flops(step, *args) -> float:
    return jax.jit(step).lower(*args).cost_analysis()["flops"]


@pytest.fixture(scope="module")
def gpt_scan_remat():
    step, state, batch = gpt.abstract(dataclasses.replace(SMALL, scan=True, remat=True), 4)
    return ir.verify(ir.trace(step, state, batch)), (step, state, batch)


@pytest.fixture(scope="module")
def gpt_unrolled_remat():
    step, state, batch = gpt.abstract(dataclasses.replace(SMALL, remat=True), 4)
    return ir.verify(ir.trace(step, state, batch)), (step, state, batch)


TWINS = {
    "mlp": lambda: mlp.abstract(16, 32, 3, 8),
    "nnx_mlp": lambda: nnx_mlp.abstract(16, 32, 3, 8),
    "convnet": lambda: convnet.abstract(convnet.ConvConfig(), 4),
    "moe_top2": lambda: moe.abstract(moe.MoEConfig(), 4),
}


@pytest.mark.parametrize("model", sorted(TWINS))
def test_flops_match_xla(model):
    step, state, batch = TWINS[model]()
    g = ir.verify(ir.trace(step, state, batch))
    assert g.fallbacks == (), g.summary()
    expected = xla_flops(step, state, batch)
    got = g.total_flops
    assert got == pytest.approx(expected, rel=0.01), f"expected {expected}, got {got}"


def test_gpt_unrolled_flops_match_xla(gpt_unrolled_remat):
    g, args = gpt_unrolled_remat
    assert g.fallbacks == ()
    assert g.total_flops == pytest.approx(xla_flops(*args), rel=0.01)
    assert any(op.scope == ("remat2",) for op in g.ops), "remat2 ops keep their scope marker"


def test_scan_counts_body_times_trip_count(gpt_scan_remat, gpt_unrolled_remat):
    g, _ = gpt_scan_remat
    scans = [op for op in g.ops if op.prim == "scan"]
    assert len(scans) == 2 and all(op.trip_count == SMALL.layers for op in scans)
    body = scans[0].regions[0]
    assert scans[0].flops == pytest.approx(SMALL.layers * sum(op.flops for op in body.ops))
    assert scans[0].param("length") == SMALL.layers and scans[0].param("num_carry") == 1
    assert len(body.inputs) == len(scans[0].ins) and len(body.outputs) == len(scans[0].outs)
    assert g.fallbacks == ()
    assert g.total_flops == pytest.approx(gpt_unrolled_remat[0].total_flops, rel=0.01)


def test_input_paths_and_types(gpt_unrolled_remat):
    g, _ = gpt_unrolled_remat
    path = "[0]['params']['layer_0']['mlp']['fc1']['kernel']"
    v = g.inputs[g.input_paths.index(path)]
    assert g.values[v] == ir.TensorType((SMALL.d_model, SMALL.d_ff), "float32")
    assert "[1]['tokens']" in g.input_paths
    assert g.output_paths[-1] == "[1]" and len(g.donated) == len(g.inputs)


def test_op_fields(gpt_unrolled_remat):
    g, _ = gpt_unrolled_remat
    fc1 = [op for op in g.ops if op.prim == "dot_general" and op.name.endswith("layer_0/mlp/fc1")]
    assert fc1, "the fc1 matmul carries its flax name stack"
    op = fc1[0]
    assert op.name.startswith("jvp(GPT)") and op.source.startswith("gpt.py:")
    assert "/" not in op.source.split(" ")[0]
    (lc, rc), (lb, rb) = op.param("dimension_numbers")
    assert lc == (2,) and rc == (0,) and lb == rb == ()
    assert op.flops == 2 * 4 * SMALL.seq * SMALL.d_model * SMALL.d_ff
    assert op.bytes_accessed == sum(g.values[v].nbytes for v in op.ins + op.outs)
    hash(tuple(o.params for o in g.all_ops()))  # params are hashable plain data
    inlined = [o for o in g.ops if len(o.origin) > 1]
    assert inlined and all(o.origin[0] < len(g.jaxpr.jaxpr.eqns) for o in inlined)


def test_literals_and_consts():
    c = np.arange(4.0, dtype=np.float32)
    g = ir.trace(lambda x: x * 2.0 + jnp.asarray(c), jax.ShapeDtypeStruct((4,), jnp.float32))
    assert 2.0 in dict(g.literals).values()
    ir.verify(g)


def test_kwargs_and_donation():
    f = lambda a, b, scale: (a["w"] * scale, b)  # noqa: E731
    x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    g = ir.trace(f, {"w": x}, x, donate_argnums=(0,), scale=3.0)
    assert g.input_paths == ("[0]['w']", "[1]") and g.donated == (True, False)


def test_while_and_cond_regions():
    def f(x):
        _, y = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))
        return jax.lax.cond(y.sum() > 0, lambda v: jnp.exp(v), lambda v: v @ v, y)
    g = ir.verify(ir.trace(f, jax.ShapeDtypeStruct((8, 8), jnp.float32)))
    loop = next(op for op in g.all_ops() if op.prim == "while")
    assert len(loop.regions) == 2 and loop.trip_count == 1
    branch = next(op for op in g.all_ops() if op.prim == "cond")
    assert len(branch.regions) == 2 and branch.flops == 2 * 8 * 8 * 8


def _mystery_prim(name: str) -> jcore.Primitive:
    p = jcore.Primitive(name)
    p.def_abstract_eval(lambda x, **_: x)  # same shape and dtype as the input
    return p


def test_unknown_primitive_falls_back():
    p = _mystery_prim("mystery_op")
    g = ir.trace(lambda x: p.bind(x) + 1.0, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    op = g.op(g.fallbacks[0])
    assert op.prim == "mystery_op" and op.flops == 0 and op.bytes_accessed == 2 * 4 * 8 * 4
    assert "fallback" in g.summary()


def test_unknown_subjaxpr_raises_with_source():
    p = _mystery_prim("mystery_call")
    body = jax.make_jaxpr(jnp.sin)(jnp.ones(3))
    with pytest.raises(ir.UnsupportedPrimitiveError, match=r"mystery_call.*test_ir_trace.py:\d+"):
        ir.trace(lambda x: p.bind(x, body=body), jax.ShapeDtypeStruct((3,), jnp.float32))
    assert issubclass(ir.UnsupportedPrimitiveError, ValueError)


def test_175b_traces_from_shapes_without_allocating():
    cfg = dataclasses.replace(gpt.GPT_CONFIGS["175B"], scan=True)
    step, state, batch = gpt.abstract(cfg, 8)
    before = len(jax.live_arrays())
    t0 = time.perf_counter()
    g = ir.trace(step, state, batch)
    print(f"175B scan trace: {time.perf_counter() - t0:.2f}s, {len(g.all_ops())} ops")
    assert len(jax.live_arrays()) == before
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize
                      for x in jax.tree_util.tree_leaves(state["params"]))
    got = sum(g.values[v].nbytes for v, p in zip(g.inputs, g.input_paths)
              if p.startswith("[0]['params']"))
    assert got == param_bytes and param_bytes > 100e9 * 4
    assert g.total_flops > 6 * 175e9 * 8 * cfg.seq  # at least 6 N tokens
