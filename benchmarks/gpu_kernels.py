"""autopar's Pallas kernels against XLA's own code and cuDNN attention, on one GPU.

For GPT-1.3B (d 2048, 32 heads of 64, vocabulary 51200) and Llama shapes (Llama-2-7B: d 4096,
32 heads of 128, vocabulary 32000; Llama-3-8B: 8 key/value heads, vocabulary 128256), bf16,
16384 tokens per step (batch = 16384 / sequence), causal, sequence 2048, 4096 and 8192:

  kernel       implementations                                         modes
  attention    pallas (autopar.kernels.attention), xla (the unfused    fwd, fwd+bwd
               jnp reference under jit), cudnn
               (jax.nn.dot_product_attention(implementation="cudnn"))
  norm         pallas (layer_norm / rms_norm with the residual add),   fwd, fwd+bwd
               xla (norm_reference)
  xent         pallas (lm_head_cross_entropy), xla (full logits)       fwd, fwd+bwd
  adamw        pallas (adamw_update), xla (optax.adamw, one leaf)      update

Each row: the median of ``--repeats`` timed calls after two warm-up calls, the throughput (model
FLOPs per second for attention and cross-entropy, counted as the unfused step counts them,
causal attention at half the square; compulsory HBM bytes per second for norm and adamw), XLA's
temporary memory of the compiled call, and for the Pallas rows the time
``autopar.kernels.costs`` predicts on the device's profile, with measured / predicted.

    python benchmarks/gpu_kernels.py                      # a GPU: results/gpu_kernels.md
    python benchmarks/gpu_kernels.py --quick --interpret  # CPU check of the script

``--interpret`` runs the kernels in Pallas' interpreter on the CPU (a test of the script, not a
measurement); its results go to ``gpu_kernels_interpret.md``. A failing implementation (say a
kernel the Triton lowering rejects) becomes a row that says why; the rest still run.
"""
from __future__ import annotations

import os
import sys

INTERPRET = "--interpret" in sys.argv
if not INTERPRET:
    os.environ.setdefault("JAX_PLATFORMS", "")   # keep the GPU: _common defaults to the CPU

import dataclasses  # noqa: E402
from collections.abc import Callable  # noqa: E402

import _common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import cost_models  # noqa: E402
from autopar import kernels as K  # noqa: E402
from autopar.kernels import costs as C  # noqa: E402
from cost_models.measure import median_time_s  # noqa: E402

HEADER = ("kernel", "model", "shape", "mode", "impl", "median_ms", "throughput", "unit",
          "temp_MB", "predicted_ms", "measured/predicted", "speedup_vs_xla", "status")
TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    width: int
    heads: int
    kv_heads: int
    vocab: int
    norm: str          # "layer" | "rms"


MODELS = (Model("GPT-1.3B", 2048, 32, 32, 51200, "layer"),
          Model("Llama-2-7B", 4096, 32, 32, 32000, "rms"),
          Model("Llama-3-8B", 4096, 32, 8, 128256, "rms"))
TINY = (Model("GPT-tiny", 128, 2, 2, 512, "layer"), Model("Llama-tiny", 128, 2, 1, 384, "rms"))


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: str
    model: str
    shape: str
    mode: str
    impl: str
    make: Callable[[], tuple[Callable, tuple]]   # -> (jitted fn, args)
    work: float                                  # FLOPs or bytes of one call
    unit: str                                    # "TFLOP/s" | "GB/s"
    cost: C.KernelCost | None = None             # the Pallas rows' cost-model entry


# ---- cases ------------------------------------------------------------------------------------
def _rand(shape, dtype, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * scale
    return jnp.asarray(x, dtype)


def attention_cases(m: Model, seq: int, batch: int, backend: str, dtype) -> list[Case]:
    dh = m.width // m.heads
    shape = f"B{batch} S{seq} H{m.heads}/{m.kv_heads} D{dh}"
    blocks = K.AttentionBlocks(32, 32, 32, 32) if backend == "interpret" else K.AttentionBlocks()

    def args():
        return (_rand((batch, seq, m.heads, dh), dtype, 1), _rand((batch, seq, m.kv_heads, dh),
                dtype, 2), _rand((batch, seq, m.kv_heads, dh), dtype, 3))

    impls = {"pallas": lambda q, k, v: K.attention(q, k, v, blocks=blocks, backend=backend),
             "xla": lambda q, k, v: K.attention_reference(q, k, v)}
    if not INTERPRET:
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")
    flops = 4.0 * batch * m.heads * seq * seq * dh / 2          # causal: half the square
    cost = {"fwd": C.attention_fwd_cost(batch, seq, seq, m.heads, m.kv_heads, dh, 2,
                                        blocks=blocks)}
    cost["fwd+bwd"] = cost["fwd"] + C.attention_bwd_cost(batch, seq, seq, m.heads, m.kv_heads,
                                                         dh, 2, blocks=blocks)
    out = []
    for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):   # bwd = 2.5 fwd matmuls (FA2 count)
        for impl, fn in impls.items():
            out.append(Case("attention", m.name, shape, mode, impl,
                            _maker(fn, args, mode), flops * mult, "TFLOP/s",
                            cost[mode] if impl == "pallas" else None))
    return out


def norm_cases(m: Model, tokens: int, backend: str, dtype) -> list[Case]:
    shape = f"N{tokens} D{m.width} residual"
    bias = m.norm == "layer"

    def args():
        return (_rand((tokens, m.width), dtype, 4), _rand((tokens, m.width), dtype, 5),
                jnp.ones((m.width,), dtype), jnp.zeros((m.width,), dtype))

    def pallas(x, r, s, b):
        if bias:
            return K.layer_norm(x, s, b, r, backend=backend)
        return K.rms_norm(x, s, r, backend=backend)

    def xla(x, r, s, b):
        return K.norm_reference(m.norm, x, s, b if bias else None, r)

    itemsize = jnp.dtype(dtype).itemsize
    fwd = C.norm_fwd_cost(tokens, m.width, itemsize, m.norm, True)
    cost = {"fwd": fwd, "fwd+bwd": fwd + C.norm_bwd_cost(tokens, m.width, itemsize, m.norm, True)}
    return [Case("norm", m.name, shape, mode, impl, _maker(fn, args, mode, argnums=(0, 1, 2)),
                 cost[mode].hbm_bytes, "GB/s", cost[mode] if impl == "pallas" else None)
            for mode in ("fwd", "fwd+bwd") for impl, fn in (("pallas", pallas), ("xla", xla))]


def xent_cases(m: Model, tokens: int, backend: str, dtype) -> list[Case]:
    shape = f"N{tokens} D{m.width} V{m.vocab}"
    targets = jnp.asarray(np.random.default_rng(6).integers(0, m.vocab, tokens), jnp.int32)
    blocks = (K.XentBlocks(32, 64, 64, 256) if backend == "interpret" else K.XentBlocks())

    def args():
        return (_rand((tokens, m.width), dtype, 7), _rand((m.width, m.vocab), dtype, 8, 0.02))

    impls = {"pallas": lambda h, w: K.lm_head_cross_entropy(h, w, targets, blocks=blocks,
                                                            backend=backend),
             "xla": lambda h, w: K.cross_entropy_reference(h, w, targets)}
    flops = 2.0 * tokens * m.width * m.vocab
    itemsize = jnp.dtype(dtype).itemsize
    fwd = C.xent_fwd_cost(tokens, m.width, m.vocab, itemsize, blocks=blocks)
    cost = {"fwd": fwd, "fwd+bwd": fwd + C.xent_bwd_cost(tokens, m.width, m.vocab, itemsize,
                                                         blocks=blocks)}
    return [Case("xent", m.name, shape, mode, impl, _maker(fn, args, mode), flops * mult,
                 "TFLOP/s", cost[mode] if impl == "pallas" else None)
            for mode, mult in (("fwd", 1.0), ("fwd+bwd", 3.0)) for impl, fn in impls.items()]


def adamw_cases(m: Model, backend: str) -> list[Case]:
    rows, cols = (m.width, 4 * m.width) if m.norm == "layer" else (m.width, m.width * 11 // 4)
    shape = f"{rows}x{cols} f32"
    hyper = K.AdamWHyper(weight_decay=0.01)
    tx = optax.adamw(1e-3, weight_decay=0.01)

    def args():
        p, g = _rand((rows, cols), jnp.float32, 9), _rand((rows, cols), jnp.float32, 10)
        return p, g, jnp.zeros_like(p), jnp.zeros_like(p)

    def pallas(p, g, mu, nu):
        return K.adamw_update(p, g, mu, nu, lr=1e-3, bc1=0.1, bc2=0.001, hyper=hyper,
                              backend=backend)

    def xla(p, g, mu, nu):
        state = (optax.ScaleByAdamState(jnp.zeros([], jnp.int32), mu, nu),) + tx.init(p)[1:]
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state[0].mu, state[0].nu

    cost = C.adamw_cost(rows * cols)
    return [Case("adamw", m.name, shape, "update", impl, _maker(fn, args, "fwd"), cost.hbm_bytes,
                 "GB/s", cost if impl == "pallas" else None)
            for impl, fn in (("pallas", pallas), ("xla", xla))]


def _maker(fn: Callable, args: Callable, mode: str, argnums=(0, 1, 2)):
    """A thunk building (jitted call, arguments): forward, or forward plus the VJP."""
    def make():
        a = args()
        if mode != "fwd+bwd":
            return jax.jit(fn), a
        nums = tuple(i for i in argnums if i < len(a))

        def both(*xs):
            out, vjp = jax.vjp(lambda *d: fn(*[d[nums.index(i)] if i in nums else x
                                               for i, x in enumerate(xs)]),
                               *[xs[i] for i in nums])
            return out, vjp(jax.tree.map(jnp.ones_like, out))
        return jax.jit(both), a
    return make


# ---- running ----------------------------------------------------------------------------------
def measure(case: Case, repeats: int, hw) -> list:
    try:
        fn, a = case.make()
        compiled = fn.lower(*a).compile()
        temp = compiled.memory_analysis()
        temp_mb = temp.temp_size_in_bytes / 2**20 if temp is not None else float("nan")
        t = median_time_s(compiled, a, repeats, warmup=2)
    except Exception as e:  # a failing implementation is a result: say why, keep going
        msg = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        print(f"  {case.kernel} {case.model} {case.mode} {case.impl}: {msg}")
        nan = float("nan")
        return [case.kernel, case.model, case.shape, case.mode, case.impl, nan, nan, case.unit,
                nan, nan, nan, nan, msg]
    scale = 1e12 if case.unit == "TFLOP/s" else 1e9
    predicted = case.cost.time_s(hw) if case.cost is not None and hw is not None else float("nan")
    row = [case.kernel, case.model, case.shape, case.mode, case.impl, t * 1e3,
           case.work / t / scale, case.unit, temp_mb, predicted * 1e3,
           t / predicted if predicted == predicted else float("nan"), float("nan"), "ok"]
    print(f"  {case.kernel:9s} {case.model:10s} {case.shape:26s} {case.mode:7s} "
          f"{case.impl:6s} {t * 1e3:9.3f} ms {row[6]:8.2f} {case.unit}")
    return row


def add_speedups(rows: list[list]) -> None:
    """speedup_vs_xla = xla's time / this row's time, for rows of one (kernel, shape, mode)."""
    xla = {tuple(r[:4]): r[5] for r in rows if r[4] == "xla"}
    for r in rows:
        ref = xla.get(tuple(r[:4]))
        if ref is not None and r[5] == r[5]:
            r[11] = ref / r[5]


def build(quick: bool, backend: str) -> list[Case]:
    dtype = jnp.bfloat16 if not INTERPRET else jnp.float32
    models = TINY[1:] if quick else MODELS       # quick: Llama-tiny (grouped-query, RMSNorm)
    seqs = (128,) if quick else (2048, 4096, 8192)
    tokens = 256 if quick else TOKENS
    cases: list[Case] = []
    for m in models:
        for seq in seqs:
            cases += attention_cases(m, seq, max(1, tokens // seq), backend, dtype)
        cases += norm_cases(m, tokens, backend, dtype)
        cases += xent_cases(m, tokens, backend, dtype)
        cases += adamw_cases(m, backend)
    return cases


def device_profile():
    """The shipped profile of the device (``None`` if it has none): the prediction's basis."""
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100"):
        if name in kind:
            return cost_models.hardware(name)
    return cost_models.hardware("cpu") if jax.default_backend() == "cpu" else None


def gpu_args(doc: str, interpret_help: str, repeats: int):
    """The GPU benchmarks' arguments (``--interpret``, ``--repeats`` beside ``_common``'s); exits
    with the fix when there is no GPU and ``--interpret`` was not given."""
    p = _common.parser(doc)
    p.add_argument("--interpret", action="store_true", help=interpret_help)
    p.add_argument("--repeats", type=int, default=repeats)
    args = p.parse_args()
    if not args.interpret and jax.default_backend() != "gpu":
        sys.exit(f"no GPU here (jax backend {jax.default_backend()!r}); run with --interpret "
                 f"to check the script on the CPU")
    return args


def main() -> None:
    args = gpu_args(__doc__, "run the kernels in Pallas' interpreter on the CPU (a script check)",
                    repeats=20)
    backend = "interpret" if INTERPRET else "triton"
    hw = None if INTERPRET else device_profile()     # interpreter times predict nothing
    repeats = 2 if args.quick else args.repeats
    rows = [measure(c, repeats, hw) for c in build(args.quick, backend)]
    add_speedups(rows)
    write(args, rows, hw)


def write(args, rows: list[list], hw) -> None:
    out = _common.out_dir(args)
    stem = "gpu_kernels_interpret" if INTERPRET else "gpu_kernels"
    _common.write_csv(out / f"{stem}.csv", HEADER, rows)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    failed = [r for r in rows if r[-1] != "ok"]
    lines = [
        "# autopar Pallas kernels vs XLA and cuDNN" + (" (interpret-mode check)" if INTERPRET
                                                       else ""),
        "",
        f"Device: {device}; jax {jax.__version__}; prediction profile: "
        f"{hw.name if hw is not None else 'none'}.",
        f"Environment: {_common.environment()}.",
        "",
        "Medians of timed calls after warm-up. Throughput: model FLOPs (causal attention at half "
        "the square, backward at 2.5x the forward; cross-entropy at the unfused step's matmul "
        "FLOPs) or compulsory HBM bytes per second. temp_MB: XLA's temporary buffers of the "
        "compiled call. predicted_ms: `autopar.kernels.costs` on the device's profile.",
        "",
    ]
    if INTERPRET:
        lines += ["Interpret mode runs every kernel in Pallas' interpreter on the CPU: the "
                  "times say nothing about GPU speed; this file only shows the script works.", ""]
    if failed:
        lines += [f"{len(failed)} of {len(rows)} rows failed (status column).", ""]
    lines.append(_common.md_table(HEADER, rows))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / (stem + '.md')}")


if __name__ == "__main__":
    main()
