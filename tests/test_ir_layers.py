"""ir.layers: repeated blocks and structural roles of unrolled and scanned models, by structure."""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import jax
import jax.numpy as jnp
import optax
import pytest

import ir
from autopar.models import adamw_step, gpt, nnx_mlp
from ir.layers import module_path, roles

CFG = gpt.GPTConfig(layers=4, d_model=32, heads=2, d_ff=64, seq=16, vocab=64)


@functools.cache
def _gpt(layers: int = 4, remat: bool = False, scan: bool = False) -> ir.Graph:
    cfg = dataclasses.replace(CFG, layers=layers, remat=remat, scan=scan)
    return ir.trace(*gpt.abstract(cfg, 2))


def test_unrolled_gpt_has_four_equal_layers():
    g = _gpt(4)
    blocks = [layer for layer in g.layers if layer.name.startswith("GPT/layer_")]
    assert [b.name for b in blocks] == [f"GPT/layer_{i}" for i in range(4)]
    assert len({b.signature for b in blocks}) == 1 and len({len(b.op_ids) for b in blocks}) == 1
    for b in blocks:  # forward and backward ops of the block, layer index set on each op
        names = {g.op(i).name.split("/")[0] for i in b.op_ids}
        assert {"jvp(GPT)", "transpose(jvp(GPT))"} <= names
        assert all(g.op(i).layer == b.index for i in b.op_ids)
    first, second = blocks[0], blocks[1]
    assert [g.op(i).prim for i in first.op_ids] == [g.op(i).prim for i in second.op_ids]


def test_remat_gpt_blocks_forward_and_backward():
    """With remat the backward recomputes each block from its input, so it reads the previous
    block's output rather than residuals: forward and backward blocks stay two families."""
    g = _gpt(remat=True)
    families = Counter(layer.signature for layer in g.layers if layer.name.startswith("GPT/layer_"))
    assert sorted(families.values()) == [4, 4]
    names = Counter(layer.name for layer in g.layers if layer.name.startswith("GPT/layer_"))
    assert names == {f"GPT/layer_{i}": 2 for i in range(4)}


def test_scan_gpt_layers():
    g = _gpt(scan=True)
    scans = [layer for layer in g.layers if layer.kind == "scan"]
    assert len(scans) == 2 and all(layer.repeats == 4 for layer in scans)
    fwd = scans[0]
    scan_op = g.op(fwd.op_ids[0])
    assert scan_op.prim == "scan" and len(fwd.op_ids) == 1 + len(scan_op.regions[0].ops)
    assert g.op(fwd.op_ids[1]).layer == fwd.index


# ---- roles ----------------------------------------------------------------------------------
def _input_role(g: ir.Graph, suffix: str) -> int:
    (k,) = [k for k, p in enumerate(g.input_paths) if p.endswith(suffix)]
    return roles(g).input[k]


def test_roles_do_not_grow_with_depth():
    """The same number of distinct roles for 4 and 8 layers: every added layer repeats one."""
    four, eight = roles(_gpt(4)), roles(_gpt(8))
    assert four.distinct == eight.distinct
    assert len(eight.op) > 1.8 * len(four.op)


def test_parameters_and_moments_of_equal_layers_share_a_role():
    g = _gpt(4)
    fc1 = {i: _input_role(g, f"['params']['layer_{i}']['mlp']['fc1']['kernel']") for i in range(4)}
    mu = {i: _input_role(g, f".mu['layer_{i}']['mlp']['fc1']['kernel']") for i in range(4)}
    assert len(set(fc1.values())) == 1 and len(set(mu.values())) == 1
    fc2 = _input_role(g, "['params']['layer_0']['mlp']['fc2']['kernel']")
    assert len({fc1[0], mu[0], fc2}) == 3


def _loop_step(n_blocks: int, width: int = 32, table: str | None = None):
    """An anonymous Python loop over a list of weight dicts: no module names at all. With
    ``table`` ("batch" or "params"), block ``i`` also scales by row ``i`` of a per-layer table
    there (as HF BERT's ``head_mask[i]``)."""
    def loss_fn(params, batch):
        x = batch["x"]                                   # (B, W)
        for i, blk in enumerate(params["blocks"]):
            if table:
                x = x * {"batch": batch, "params": params}[table]["table"][i]
            x = x + jnp.tanh(x @ blk["a"]) @ blk["b"]
        return jnp.mean((x @ params["out"] - batch["y"]) ** 2)

    tx = optax.adamw(1e-3)
    sd = jax.ShapeDtypeStruct
    params = {"blocks": [{"a": sd((width, 2 * width), jnp.float32),
                          "b": sd((2 * width, width), jnp.float32)} for _ in range(n_blocks)],
              "out": sd((width, 4), jnp.float32)}
    batch = {"x": sd((8, width), jnp.float32), "y": sd((8, 4), jnp.float32)}
    if table:
        {"batch": batch, "params": params}[table]["table"] = sd((n_blocks, width), jnp.float32)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    return adamw_step(loss_fn, tx), state, batch


def test_anonymous_loop_blocks_and_roles():
    """Six forward blocks of one signature; the first block's backward differs (it needs no
    input gradient), so roles agree from the second block on."""
    g = ir.trace(*_loop_step(6))
    _assert_six_blocks_from_the_second_alike(g, "dot_general")
    assert roles(g).distinct == roles(ir.trace(*_loop_step(9))).distinct


def _assert_six_blocks_from_the_second_alike(g: ir.Graph, first_prim: str) -> None:
    """Six forward blocks of one signature from the graph's first op (``first_prim``), and the
    weights of blocks 1-5 share a role per weight."""
    families = Counter(layer.signature for layer in g.layers)
    forward = [layer for layer in g.layers if g.op(layer.op_ids[0]).prim == first_prim
               and families[layer.signature] == 6]
    assert len(forward) == 6 and forward[0].op_ids[0] == g.ops[0].id
    a = {_input_role(g, f"['params']['blocks'][{i}]['a']") for i in range(1, 6)}
    b = {_input_role(g, f"['params']['blocks'][{i}]['b']") for i in range(1, 6)}
    assert len(a) == 1 and len(b) == 1 and a != b


def test_rows_of_a_per_layer_table_do_not_break_the_blocks():
    """Block ``i`` scales by row ``i`` of a per-layer input table (a slice that differs from
    block to block only in its row): the blocks are one family and their weights share roles
    from the second block on, as without the table."""
    _assert_six_blocks_from_the_second_alike(ir.trace(*_loop_step(6, table="batch")), "slice")


def test_rows_of_a_per_layer_parameter_table_share_roles_between_the_ends():
    """A trained table: each block's backward puts its row's gradient back with a ``pad`` that
    differs only in the row, and adds it to the table's gradient. The last block's backward
    starts that sum (one op fewer) and the first needs no input gradient, so the blocks between
    share roles (partial: the ends plan apart)."""
    g = ir.trace(*_loop_step(6, table="params"))
    a = [_input_role(g, f"['params']['blocks'][{i}]['a']") for i in range(6)]
    assert len(set(a[1:5])) == 1


def test_nnx_list_layers_share_roles():
    g = ir.trace(*nnx_mlp.abstract(16, 32, 6, 8))
    kernels = {_input_role(g, f"['params']['layers'][{i}]['kernel'].value") for i in range(1, 6)}
    assert len(kernels) <= 2, kernels   # the first layer (16 wide) differs; the rest repeat


def test_nan_literals_do_not_break_the_blocks():
    """Equinox's attention and layer norm read NaN literals. NaN never equals itself, so each
    such op used to get a label of its own in every layer: the forward was never cut into
    blocks and each layer's backward stood alone (no recomputation site, no fold). Each block
    is its forward and its backward, one family."""
    from autopar.models import zoo

    cfg = zoo.Config(layers=3, width=32, seq=8, ff=64, heads=2, batch=2)
    step, params, opt, batch = zoo.eqx_lm(cfg, abstract=True)
    g = ir.trace(step, params, opt, batch)
    assert any(x != x for _, x in g.literals if isinstance(x, float))   # the case at hand
    first_bwd = min(op.id for op in g.ops if "transpose(" in op.name)
    most = max(len(layer.op_ids) for layer in g.layers)
    family = [layer for layer in g.layers if len(layer.op_ids) == most]
    assert len(family) == 3 and len({la.signature for la in family}) == 1
    for layer in family:    # forward and backward in one block
        assert min(layer.op_ids) < first_bwd < max(layer.op_ids)


@pytest.mark.parametrize("name, path", [
    ("transpose(jvp(GPT))/layer_3/mlp", "GPT/layer_3/mlp"),
    ("jvp(MLP)/Dense_1", "MLP/Dense_1"),
    ("transpose(jvp(GPT))/jvp(GPT)/rematted_computation/layer_3/ln1", "GPT/layer_3/ln1"),
    ("jvp(FlaxGPT2LMHeadModule)/transformer/h/0/attn", "FlaxGPT2LMHeadModule/transformer/h/0/attn"),
    ("", ""),
])
def test_module_path(name, path):
    assert module_path(name) == path
