"""ir.patterns on full adamw training steps: GPT (LayerNorm, multi-head) and Llama-style
(RMSNorm, rotary, grouped-query, SwiGLU), unrolled and scanned, plus plain-jnp and
``jax.nn.dot_product_attention`` attention and optax's cross-entropy; transformers' Flax Llama,
Mistral, Gemma and GPT-2 and an NNX language model (masks from the batch, grouped- and
multi-query heads, remat and scan bodies)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest

import ir
from autopar.models import gpt, llama, moe
from ir.patterns import PATTERNS, Match, counts, find_patterns

LAYERS = 3
GPT = gpt.GPTConfig(layers=LAYERS, d_model=32, heads=2, d_ff=64, seq=24, vocab=64)
LLAMA = llama.LlamaConfig(layers=LAYERS, d_model=32, heads=4, kv_heads=2, d_ff=48, seq=12,
                          vocab=40)
GPT_LEAVES = 11 * LAYERS + 5      # per block: 2 norms x 2, qkv, out kernel + bias, 2 x (k, b)
LLAMA_LEAVES = 9 * LAYERS + 3     # per block: 2 norm scales, q, k, v, o, gate, up, down


def _expected(blocks: int, leaves: int) -> dict[str, int]:
    norms = 2 * blocks + 1
    return {"attention_fwd": blocks, "attention_bwd": blocks, "norm_fwd": norms,
            "norm_bwd": norms, "xent_fwd": 1, "xent_bwd": 1, "adamw": leaves}


CASES = {
    "gpt": (gpt, GPT, _expected(LAYERS, GPT_LEAVES)),
    "gpt_scan": (gpt, dataclasses.replace(GPT, scan=True), _expected(1, 16)),
    # bfloat16 compute (the papers' configs): softmax sums in float32 behind converts
    "gpt_bf16": (gpt, dataclasses.replace(GPT, dtype=jnp.bfloat16), _expected(LAYERS, GPT_LEAVES)),
    "llama": (llama, LLAMA, _expected(LAYERS, LLAMA_LEAVES)),
    "llama_scan": (llama, dataclasses.replace(LLAMA, scan=True), _expected(1, 12)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def traced(request):
    module, cfg, expected = CASES[request.param]
    graph = ir.trace(*module.abstract(cfg, 2))
    return request.param, cfg, graph, find_patterns(graph), expected


def _prims(graph, m: Match) -> list[str]:
    return [graph.op(i).prim for i in m.op_ids]


def test_expected_counts(traced):
    name, _, _, matches, expected = traced
    got = counts(matches)
    assert dict(got) == expected, f"{name}: expected {expected}, got {dict(got)}"
    assert set(got) <= set(PATTERNS)


def test_matches_are_disjoint_and_point_to_their_forward(traced):
    _, _, graph, matches, _ = traced
    seen: set[int] = set()
    for m in matches:
        assert m.op_ids and not seen.intersection(m.op_ids), m.pattern
        seen.update(m.op_ids)
        assert m.sources, f"{m.pattern} has no source lines"
        if m.pattern.endswith("_bwd"):
            assert matches[m.forward].pattern == m.pattern.replace("_bwd", "_fwd")
    ops = {op.id for op in graph.all_ops()}
    assert seen <= ops


def test_attention(traced):
    name, cfg, graph, matches, _ = traced
    dh = cfg.d_model // cfg.heads
    for m in (m for m in matches if m.pattern == "attention_fwd"):
        assert _prims(graph, m).count("dot_general") == 2
        assert m.attr("causal") is True and m.attr("scale") == pytest.approx(1 / math.sqrt(dh))
        assert {"q", "k", "v"} <= set(m.roles()) and m.roles("outputs") == ("out",)
        q, k = graph.type(m.input("q")).shape, graph.type(m.input("k")).shape
        kv_heads = getattr(cfg, "kv_heads", cfg.heads)
        assert k == (2, cfg.seq, kv_heads, dh)                 # (B, S, Hkv, Dh)
        assert math.prod(q) == math.prod(k) * cfg.heads // kv_heads   # grouped queries
        assert graph.type(m.output("out")).shape == (2, cfg.seq, cfg.heads, dh)
        assert any(f"{name.split('_')[0]}.py" in s for s in m.sources)
    for m in (m for m in matches if m.pattern == "attention_bwd"):
        assert _prims(graph, m).count("dot_general") == 4   # dP, dV, dQ, dK
        grads = dict((r, v) for r, v in m.outputs if r in ("dq", "dk", "dv"))
        fwd = matches[m.forward]
        assert set(grads) == {"dq", "dk", "dv"}
        for role in ("q", "k", "v"):
            assert graph.type(grads["d" + role]).shape == graph.type(fwd.input(role)).shape
        assert "dout" in m.roles() and {"q", "k", "v"} <= set(m.roles())


def test_norms(traced):
    name, cfg, graph, matches, _ = traced
    kind = "layer" if name.startswith("gpt") else "rms"
    fwd = [m for m in matches if m.pattern == "norm_fwd"]
    assert {m.attr("kind") for m in fwd} == {kind}
    # Unrolled: every norm but the first block's first one adds the residual stream first. In a
    # scan only the second norm of the body does: the other adds reach it through the carry.
    assert sum(m.attr("residual") for m in fwd) == (1 if name.endswith("scan") else len(fwd) - 1)
    for m in fwd:
        assert "dot_general" not in _prims(graph, m)
        assert set(m.roles()) >= {"x", "scale"} | ({"bias"} if kind == "layer" else set())
        assert m.roles("outputs") == (("y", "h") if m.attr("residual") else ("y",))
        assert graph.type(m.output("y")).shape[-1] == cfg.d_model
    for m in (m for m in matches if m.pattern == "norm_bwd"):
        assert "dot_general" not in _prims(graph, m)
        roles = set(m.roles("outputs"))
        assert {"dx", "dscale"} <= roles and ("dbias" in roles) == (kind == "layer")
        assert "dy" in m.roles()


def _input_path(graph, v: int) -> str:
    """The graph input ``v`` is (a dtype cast of): bf16 models cast their float32 weights."""
    while (op := graph.producer(v)) is not None and op.prim == "convert_element_type":
        v = op.ins[0]
    return dict(zip(graph.inputs, graph.input_paths))[v]


def test_cross_entropy(traced):
    _, cfg, graph, matches, _ = traced
    (fwd,) = [m for m in matches if m.pattern == "xent_fwd"]
    (bwd,) = [m for m in matches if m.pattern == "xent_bwd"]
    assert "lm_head" in _input_path(graph, fwd.input("w"))
    assert "targets" in _input_path(graph, fwd.input("targets"))
    assert fwd.attr("vocab") == cfg.vocab and _prims(graph, fwd).count("dot_general") == 1
    assert _prims(graph, bwd).count("dot_general") == 2
    assert {"dh", "dw"} <= set(bwd.roles("outputs")) and "dloss" in bwd.roles()


def test_adamw_maps_each_parameter_to_its_update(traced):
    _, _, graph, matches, _ = traced
    ins = dict(zip(graph.inputs, graph.input_paths))
    outs = dict(zip(graph.outputs, graph.output_paths))
    updated = set()
    for m in (m for m in matches if m.pattern == "adamw"):
        path = ins[m.input("param")]
        assert outs[m.output("param")] == path and path.startswith("[0]['params']")
        assert ins[m.input("mu")].endswith(path.removeprefix("[0]['params']"))
        assert m.attr("b1") == pytest.approx(0.9) and m.attr("b2") == pytest.approx(0.999)
        assert m.attr("weight_decay") == pytest.approx(0.01) and m.attr("lr") == \
            pytest.approx(1e-3)
        updated.add(path)
    assert updated == {p for p in graph.input_paths if p.startswith("[0]['params']")}


def test_scanned_patterns_live_in_loop_bodies():
    graph = ir.trace(*gpt.abstract(dataclasses.replace(GPT, scan=True), 2))
    scans = [op.id for op in graph.ops if op.prim == "scan"]
    by = {m.pattern: m for m in find_patterns(graph)}
    assert by["attention_fwd"].region == scans[0] and by["attention_bwd"].region == scans[1]
    assert by["attention_fwd"].roles().count("mask") == 1     # the mask is hoisted out of the loop
    assert by["xent_fwd"].region is None


def test_remat_recomputed_forwards_are_marked():
    graph = ir.trace(*gpt.abstract(dataclasses.replace(GPT, layers=2, remat=True), 2))
    matches = find_patterns(graph)
    attn = [m for m in matches if m.pattern == "attention_fwd"]
    assert sorted(bool(m.attr("recompute")) for m in attn) == [False, False, True, True]
    assert counts(matches)["attention_bwd"] == 2
    assert all(matches[m.forward].attr("recompute") for m in matches
               if m.pattern == "attention_bwd")


def _plain_attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    s = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("fn, mask", [
    (_plain_attention, "causal"),
    (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                  implementation="xla"), "causal"),
    (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"), "none"),
])
def test_attention_without_flax(fn, mask):
    x = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.float32)
    graph = ir.trace(jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), argnums=(0, 1, 2)),
                     x, x, x)
    matches = find_patterns(graph)
    assert dict(counts(matches)) == {"attention_fwd": 1, "attention_bwd": 1}
    fwd, bwd = matches
    assert fwd.attr("mask") == mask and fwd.input("k") == graph.inputs[1]
    assert set(bwd.roles("outputs")) == {"dq", "dk", "dv"}


def test_optax_cross_entropy_and_moe_router():
    def loss(h, w, t):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w, t).mean()

    sds = jax.ShapeDtypeStruct
    graph = ir.trace(jax.value_and_grad(loss, argnums=(0, 1)), sds((8, 16), jnp.float32),
                     sds((16, 32), jnp.float32), sds((8,), jnp.int32))
    fwd, bwd = find_patterns(graph)
    assert (fwd.pattern, bwd.pattern) == ("xent_fwd", "xent_bwd")
    assert (fwd.input("h"), fwd.input("w"), fwd.input("targets")) == graph.inputs
    # The MoE router's softmax(x @ W) feeds a matmul too, but it is not attention.
    moe_graph = ir.trace(*moe.abstract(moe.MoEConfig(), 4))
    got = counts(find_patterns(moe_graph))
    assert got["attention_fwd"] == 0 and got["xent_fwd"] == 1


# ---- the models users bring ---------------------------------------------------------------------
def _hf_graph(name: str, **kw):
    from autopar.models import hf

    pytest.importorskip("transformers", reason="the dev extra installs transformers 4.x")
    return ir.trace(*hf.abstract(name, hf.tiny(name, layers=2, width=32), 4, **kw))


# (family, abstract options) -> (mask kind, kv heads, heads repeated by jnp.repeat, norm scale
# offset, attention roles read as data)
THIRD_PARTY = {
    ("llama", ()): ("causal", 4, 1, 0.0, ()),
    ("llama", (("padding", True),)): ("data", 4, 1, 0.0, ("bias",)),
    ("mistral", ()): ("data", 2, 2, 0.0, ("bias",)),        # a 4-token sliding window
    ("gemma", ()): ("causal", 1, 4, 1.0, ()),               # multi-query; (1 + w) * x
    ("gpt2", (("padding", True),)): ("data", 4, 1, 0.0, ("bias",)),
}


@pytest.mark.parametrize("name, options", sorted(THIRD_PARTY))
def test_transformers_attention_norms_and_loss(name, options):
    """transformers' Flax decoders: rotary embeddings stay before the scores (q and k are the
    scores matmul's operands), k and v are taken before their repeat over the heads, a mask is
    rebuilt (causal) or read as data, RMSNorm divides by a sqrt, the loss picks a log-prob."""
    mask, kv_heads, repeat, offset, data = THIRD_PARTY[name, options]
    graph = _hf_graph(name, **dict(options))
    matches = find_patterns(graph)
    got = counts(matches)
    assert (got["attention_fwd"], got["attention_bwd"], got["norm_fwd"], got["norm_bwd"],
            got["xent_fwd"], got["xent_bwd"]) == (2, 2, 5, 5, 1, 1), dict(got)
    for m in (m for m in matches if m.pattern == "attention_fwd"):
        assert (m.attr("mask"), m.attr("kv_repeat")) == (mask, repeat)
        assert graph.type(m.input("k")).shape == (4, 16, kv_heads, 8)
        assert graph.type(m.input("q")).shape == (4, 16, 4, 8)
        assert tuple(r for r in m.roles() if r in ("bias", "keep")) == data
    for m in (m for m in matches if m.pattern == "attention_bwd"):
        grads = {r: graph.type(v).shape for r, v in m.outputs}
        assert grads == {"dq": (4, 16, 4, 8), "dk": (4, 16, kv_heads, 8),
                         "dv": (4, 16, kv_heads, 8)}
    norms = [m for m in matches if m.pattern == "norm_fwd"]
    assert {m.attr("kind") for m in norms} == {"layer" if name == "gpt2" else "rms"}
    assert {m.attr("scale_offset") for m in norms} == {offset}
    (xent,) = [m for m in matches if m.pattern == "xent_fwd"]
    assert xent.attr("loss_sign") == -1.0      # -take_along_axis(logp, t).mean(): minus after


def test_remat_and_scan_bodies_of_third_party_models():
    """Patterns under jax.checkpoint (a transformers step) and in nnx.scan and nnx.remat bodies:
    the recomputed forwards are marked, scanned ones live in the loop body."""
    from autopar.models import nnx_lm

    matches = find_patterns(_hf_graph("llama", remat=True))
    attn = [m for m in matches if m.pattern == "attention_fwd"]
    assert len(attn) == 4 and sum(bool(m.attr("recompute")) for m in attn) == 2
    assert counts(matches)["attention_bwd"] == 2
    for cfg, regions in ((nnx_lm.NNXLMConfig(scan=True), True),
                         (nnx_lm.NNXLMConfig(scan=True, remat=True), True),
                         (nnx_lm.NNXLMConfig(remat=True), False)):
        graph = ir.trace(*nnx_lm.abstract(cfg, 4))
        matches = find_patterns(graph)
        attn = [m for m in matches if m.pattern == "attention_fwd"]
        assert attn and counts(matches)["attention_bwd"] >= 1, cfg
        assert all((m.region is not None) == regions for m in attn), cfg
        assert all(m.attr("mask") == "data" and "keep" in m.roles() for m in attn), cfg


def test_nnx_grouped_query_attention():
    """NNX's MultiHeadAttention with fewer key/value heads groups the queries (B, S, K, G, D)
    and names the batch's padding mask by the scores' dims."""
    from autopar.models import nnx_lm

    graph = ir.trace(*nnx_lm.abstract(nnx_lm.NNXLMConfig(kv_heads=2), 4))
    fwd = next(m for m in find_patterns(graph) if m.pattern == "attention_fwd")
    assert graph.type(fwd.input("q")).shape == (4, 16, 2, 2, 8)
    assert graph.type(fwd.input("k")).shape == (4, 16, 2, 8)
    assert sorted(fwd.attr("keep_dims")) == sorted(("B", "H", "G", "Sq", "Sk"))


def test_zoo_nnx_lm_as_the_nnx_guides_write_it():
    """The zoo's NNX decoder (nnx.make_causal_mask, nnx.LayerNorm, a three-argument optax step):
    its constant causal mask is rebuilt by the kernel. Its LM head adds a bias to the logits,
    which the cross-entropy kernel does not take: no xent match (see the kernels guide)."""
    from autopar.models import zoo

    step, params, opt_state, batch = zoo.nnx_lm(zoo.Config(layers=2, width=32), abstract=True)
    matches = find_patterns(ir.trace(step, params, opt_state, batch))
    got = counts(matches)
    assert (got["attention_fwd"], got["attention_bwd"], got["norm_fwd"], got["xent_fwd"]) == \
        (2, 2, 5, 0), dict(got)
    assert {m.attr("mask") for m in matches if m.pattern == "attention_fwd"} == {"causal"}
