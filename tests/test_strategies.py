"""Hand-written strategies: logical names, layouts, compiled collectives and numerics.

The end-to-end checks share one ``autopar.compare`` run of a small GPT on the 2x4 mesh (each
strategy planned, compiled and run once), so the suite stays fast on two cores.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import types
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
import ir
from autopar import strategies
from autopar.models import gpt, moe
from autopar.sharding import enumerate_shardings, to_spec

CFG = gpt.GPTConfig(vocab=128, seq=16, d_model=64, heads=4, d_ff=128, layers=2)
GPT_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "megatron", "megatron_sp", "fsdp_tp")
FC1 = "['params']['layer_0']['mlp']['fc1']['kernel']"
FC2 = "['params']['layer_0']['mlp']['fc2']['kernel']"
MU_FC1 = ".mu['layer_0']['mlp']['fc1']['kernel']"


def _mesh_2x4():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


@functools.cache
def small_gpt_comparison():
    """One compare call: every GPT strategy plus auto and a bogus name, planned and measured."""
    step, state, batch = gpt.concrete(CFG, 8)
    cmp = autopar.compare(step, state, batch, mesh=_mesh_2x4(), hardware="h100",
                          strategies=GPT_STRATEGIES + ("auto", "no_such_strategy"),
                          runs=2, time_limit_s=2)
    return step, state, batch, cmp


@functools.cache
def _abstract_graph(scan: bool = False) -> ir.Graph:
    step, state, batch = gpt.abstract(dataclasses.replace(CFG, scan=scan), 8)
    return ir.trace(step, state, batch)


def _index(graph: ir.Graph, fragment: str) -> int:
    (k,) = [k for k, p in enumerate(graph.input_paths) if p.endswith(fragment)]
    return k


# ---- HLO helpers ------------------------------------------------------------------------------
_COLL = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? ([\w-]+)\(([^)]*)\)(.*)$")
_INDEXING = ("constant", "partition-id", "replica-id", "iota")
_PASS_THROUGH = ("bitcast", "copy", "collective-permute", "reshape", "transpose", "convert",
                 "fusion")


def count_collectives(hlo: str) -> Counter:
    return Counter(m.group(1) for m in _COLL.finditer(hlo))


def gathered_params(hlo: str) -> list[str]:
    """The parameter paths whose value an all-gather gathers (through one-operand ops)."""
    instrs, params = {}, {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, op, operands, rest = m.groups()
        instrs[name] = (op, re.findall(r"%([\w.-]+)", operands))
        if op == "parameter" and "params" in rest:
            params[name] = re.search(r'op_name="([^"]*)"', rest).group(1)
    out = []
    for op, ins in instrs.values():
        if op not in ("all-gather", "all-gather-start") or not ins:
            continue
        src = ins[0]
        for _ in range(20):
            if src in params or src not in instrs:
                break
            sop, sins = instrs[src]
            # a slicing fusion reads (data, constant offsets, partition-id): follow the data
            data = [x for x in sins if instrs.get(x, ("",))[0] not in _INDEXING]
            if len(data) != 1 or sop not in _PASS_THROUGH:
                break
            src = data[0]
        if src in params:
            out.append(params[src].replace("\\'", "'"))
    return out


# ---- registry ---------------------------------------------------------------------------------
def test_names_and_get():
    assert set(GPT_STRATEGIES) | {"fsdp", "ep"} == set(strategies.NAMES)
    for name in strategies.NAMES:
        s = strategies.get(name)
        assert s.name == name and callable(s.fix_inputs) and callable(s.allows)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(autopar.ShardingError, match="unknown strategy 'tp'.*megatron_sp"):
        strategies.get("tp")
    with pytest.raises(autopar.ShardingError, match="takes data_axis"):
        strategies.get("dp", data="x")


def test_unknown_axis_knob():
    with pytest.raises(autopar.ShardingError, match="mesh axis 'x'"):
        strategies.get("dp", data_axis="x").fix_inputs(_abstract_graph(), {"data": 2, "model": 4})


# ---- logical names ----------------------------------------------------------------------------
@pytest.mark.parametrize("fragment, kind, names", [
    (FC1, "param", ("embed", "mlp")),
    (FC2, "param", ("mlp", "embed")),
    ("['params']['layer_0']['attn']['qkv']['kernel']", "param", ("embed", None, "heads", "kv")),
    ("['params']['layer_0']['attn']['out']['kernel']", "param", ("heads", "kv", "embed")),
    ("['params']['wte']['embedding']", "param", ("vocab", "embed")),
    ("['params']['lm_head']['kernel']", "param", ("embed", "vocab")),
    (MU_FC1, "opt_state", ("embed", "mlp")),
    ("['opt_state'][0].count", "scalar", ()),
    ("[1]['tokens']", "batch", ("batch", "seq")),
])
def test_logical_names(fragment, kind, names):
    g = _abstract_graph()
    info = strategies.annotate(g)[_index(g, fragment)]
    assert (info.kind, info.names) == (kind, names)


def test_scan_params_get_a_layers_dim():
    g = _abstract_graph(scan=True)
    info = strategies.annotate(g)[_index(g, "['params']['layers']['mlp']['fc1']['kernel']")]
    assert info.names == ("layers", "embed", "mlp")
    layout = strategies.get("megatron").fix_inputs(g, {"data": 2, "model": 4})
    assert to_spec(layout[_index(g, "['params']['layers']['mlp']['fc1']['kernel']")]) == P(
        None, None, "model")


def test_plain_mlp_alternates_column_and_row():
    from autopar.models import mlp

    step, state, batch = mlp.abstract(16, 32, 2, 8)
    g = ir.trace(step, state, batch)
    layout = strategies.get("megatron").fix_inputs(g, {"model": 4})
    spec = {p: to_spec(layout[k]) for k, p in enumerate(g.input_paths)}
    assert spec["[0]['params']['layer_0']['kernel']"] == P(None, "model")
    assert spec["[0]['params']['layer_0']['bias']"] == P("model")
    assert spec["[0]['params']['layer_1']['kernel']"] == P("model")


# ---- layouts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, fc1, mu_fc1, tokens", [
    ("dp", P(), P(), P("data")),
    ("zero1", P(), P(None, "data"), P("data")),
    ("zero2", P(), P(None, "data"), P("data")),
    ("zero3", P(None, "data"), P(None, "data"), P("data")),
    ("fsdp", P(None, "data"), P(None, "data"), P("data")),
    ("megatron", P(None, "model"), P(None, "model"), P("data")),
    ("megatron_sp", P(None, "model"), P(None, "model"), P("data", "model")),
    ("fsdp_tp", P("data", "model"), P("data", "model"), P("data")),
    ("ep", P(), P(), P("data")),
])
def test_layouts_on_2x4(name, fc1, mu_fc1, tokens):
    g = _abstract_graph()
    layout = strategies.get(name).fix_inputs(g, {"data": 2, "model": 4})
    assert len(layout) == len(g.inputs)
    got = tuple(to_spec(layout[_index(g, f)]) for f in (FC1, MU_FC1, "[1]['tokens']"))
    assert got == (fc1, mu_fc1, tokens), f"expected {(fc1, mu_fc1, tokens)}, got {got}"


@pytest.mark.parametrize("mesh", [{"data": 2, "model": 4}, {"x": 8}, {"data": 3},
                                  {"data": 2, "model": 2, "x": 2}, {"data": 1, "model": 8}])
@pytest.mark.parametrize("name", strategies.NAMES)
def test_layouts_are_ones_the_planner_offers(name, mesh):
    g = _abstract_graph()
    layout = strategies.get(name).fix_inputs(g, mesh)
    for k, v in enumerate(g.inputs):
        shape = g.values[v].shape
        assert layout[k] in enumerate_shardings(shape, mesh), (g.input_paths[k], layout[k])


def test_one_axis_mesh_defaults():
    g = _abstract_graph()
    mesh = {"x": 8}
    dp = strategies.get("dp").fix_inputs(g, mesh)
    tp = strategies.get("megatron").fix_inputs(g, mesh)
    tokens, fc1 = _index(g, "[1]['tokens']"), _index(g, FC1)
    assert (to_spec(dp[tokens]), to_spec(dp[fc1])) == (P("x"), P())
    assert (to_spec(tp[tokens]), to_spec(tp[fc1])) == (P(), P(None, "x"))


def test_indivisible_dims_stay_replicated():
    g = _abstract_graph()
    layout = strategies.get("zero3").fix_inputs(g, {"data": 3})
    assert layout[_index(g, "[1]['tokens']")] == ((), ())
    assert layout[_index(g, FC1)] == ((), ())
    qkv = "['params']['layer_0']['attn']['qkv']['kernel']"   # (64, 3, 4, 16): only 3 divides
    assert to_spec(layout[_index(g, qkv)]) == P(None, "data")


def test_moe_experts_on_the_model_axis():
    step, state, batch = moe.abstract(moe.MoEConfig(), 8)
    g = ir.trace(step, state, batch)
    layout = strategies.get("ep").fix_inputs(g, {"data": 2, "model": 4})
    assert to_spec(layout[_index(g, "['params']['layer_0']['w_in']")]) == P("model")
    assert to_spec(layout[_index(g, "[1]['tokens']")]) == P("data")


def test_zero1_forbids_reduce_scatter_on_contractions():
    dot = types.SimpleNamespace(prim="dot_general")
    split = ((("data",), ()), (("data",), ()))
    rs = types.SimpleNamespace(name="S(data)xR @ S(data)xR -> RxR|RS1", ins=split)
    ar = types.SimpleNamespace(name="S(data)xR @ S(data)xR -> RxR|AR", ins=split)
    assert not strategies.get("zero1").allows(dot, rs)
    assert strategies.get("zero1").allows(dot, ar)
    assert strategies.get("zero2").allows(dot, rs)


@pytest.mark.parametrize("name", strategies.NAMES)
def test_contractions_split_over_data(name):
    dot = types.SimpleNamespace(prim="dot_general")
    whole = types.SimpleNamespace(name="RxR @ RxS(model) -> RxS(model)",
                                  ins=(((), ()), ((), ("model",))))
    split = types.SimpleNamespace(name="S(data)xR @ RxR -> S(data)xR",
                                  ins=((("data",), ()), ((), ())))
    assert not strategies.get(name).allows(dot, whole)
    assert strategies.get(name).allows(dot, split)
    assert strategies.get(name).allows(types.SimpleNamespace(prim="add"), whole)


# ---- compiled collectives ---------------------------------------------------------------------
def _row(name):
    return small_gpt_comparison()[3][name]


def _compiled(name):
    row = _row(name)
    assert row.ok, row.error
    return row, row.compiled.as_text()


def test_dp_all_reduces_gradients_and_gathers_no_weights():
    row, hlo = _compiled("dp")
    counts = count_collectives(hlo)
    assert counts["all-reduce"] > 0, f"expected all-reduces, got {dict(counts)}"
    assert gathered_params(hlo) == []
    assert row.plan.spec_of(FC1) == P()


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero12_shard_optimizer_state_only(name):
    row, hlo = _compiled(name)
    assert row.plan.spec_of(FC1) == P() and row.plan.spec_of(MU_FC1) == P(None, "data")
    assert gathered_params(hlo) == []
    counts = count_collectives(hlo)
    # The sharded update is gathered back into replicated parameters.
    assert counts["all-gather"] > 0 and counts["all-reduce"] > 0, dict(counts)


def test_zero1_plan_never_reduce_scatters():
    """Whether ZeRO-2's plan reduce-scatters is the solver's cost call (on this 2x4 model its
    optimum all-reduces: the scattered gradient would stay replicated over `model`); that it may
    is checked in test_zero1_forbids_reduce_scatter_on_contractions."""
    z1 = [c for c in _row("zero1").plan.choices if c[1] == "dot_general"]
    assert z1 and not any("|RS" in c[3] for c in z1)


@pytest.mark.xfail(reason="XLA:CPU emits no reduce-scatter instruction: the planner's reduce-"
                          "scatters compile to all-reduce + dynamic-slice, so ZeRO-1 and ZeRO-2 "
                          "give the same HLO on the emulated devices", strict=False)
def test_zero2_hlo_has_reduce_scatter():
    _, hlo = _compiled("zero2")
    assert count_collectives(hlo)["reduce-scatter"] > 0


@pytest.mark.parametrize("name", ["zero3", "fsdp_tp"])
def test_fsdp_gathers_weights(name):
    row, hlo = _compiled(name)
    assert any("['kernel']" in p for p in gathered_params(hlo)), gathered_params(hlo)
    want = P(None, "data") if name == "zero3" else P("data", "model")
    assert row.plan.spec_of(FC1) == want


@pytest.mark.parametrize("name", ["megatron", "megatron_sp"])
def test_megatron_column_then_row(name):
    row, hlo = _compiled(name)
    assert row.plan.spec_of(FC1) == P(None, "model")
    assert row.plan.spec_of(FC2) == P("model")
    assert row.plan.spec_of("['params']['wte']['embedding']") == P("model")
    assert row.plan.spec_of("['params']['lm_head']['kernel']") == P(None, "model")
    counts = count_collectives(hlo)
    assert counts["all-reduce"] > 0, f"expected all-reduces, got {dict(counts)}"
    mlp_gathers = [p for p in gathered_params(hlo) if "['mlp']" in p]
    assert mlp_gathers == [], f"column/row MLP weights should stay sharded, got {mlp_gathers}"
    if name == "megatron_sp":
        assert row.plan.spec_of("[1]['tokens']") == P("data", "model")


def test_megatron_attention_is_head_parallel():
    _, hlo = _compiled("megatron")
    attn = [p for p in gathered_params(hlo) if "['attn']" in p]
    assert attn == [], attn


# ---- numerics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GPT_STRATEGIES + ("auto",))
def test_same_numerics_as_unsharded(name):
    step, state, batch, cmp = small_gpt_comparison()
    assert cmp[name].compiled is not None, cmp[name].error
    _assert_same_step(cmp[name].compiled, step, state, batch)


def _assert_same_step(compiled, step, state, batch) -> None:
    new_state, loss = compiled(*jax.device_put((state, batch), compiled.input_shardings[0]))
    ref_state, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(new_state["params"]),
                         jax.tree_util.tree_leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@functools.cache
def _moe_ep():
    step, state, batch = moe.concrete(moe.MoEConfig(layers=1), 8)
    cmp = autopar.compare(step, state, batch, mesh=_mesh_2x4(), hardware="h100",
                          strategies=("ep",), runs=1, time_limit_s=2, progress=False)
    return step, state, batch, cmp["ep"]


def test_ep_on_moe_shards_experts_and_matches_numerics():
    step, state, batch, row = _moe_ep()
    assert row.ok, row.error
    assert row.plan.spec_of("['params']['layer_0']['w_in']") == P("model")
    assert row.plan.spec_of("['params']['layer_0']['w_out']") == P("model")
    _assert_same_step(row.compiled, step, state, batch)


def test_ep_on_moe_keeps_experts_local():
    *_, row = _moe_ep()
    experts = [p for p in gathered_params(row.compiled.as_text()) if "w_in" in p or "w_out" in p]
    assert experts == [], f"expert weights should stay sharded, got {experts}"
