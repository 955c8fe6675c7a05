"""Megatron-LM's SC'21 weak-scaling table, planned: predicted TFLOP/s per GPU beside the paper's.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT models of 1.7B to 1T parameters (sequence 2048, vocabulary
51200, d_ff = 4 d_model, full activation recomputation, mixed precision) on 32 to 3072 A100
80GB GPUs, each row at its tensor (t), pipeline (p) and data (d = GPUs / (t p)) sizes and
global batch, with the throughput Megatron-LM measured on its asynchronous runtime. Here every
row is planned abstractly (``jax.ShapeDtypeStruct`` inputs, nothing runs) on the ``a100``
profile, this project's GPT at the row's shapes (scanned layers, full remat, bfloat16 compute):

* **megatron_3d**: the paper's (t, p, d) with Megatron's kernel splits pinned inside a stage
  (``StageLayouts``), one sequence per data shard per microbatch, 1F1B plain or interleaved
  with 2 virtual stages (the better is kept). Rows with p = 1 are not pipelined: the whole
  step planned with ``strategy="megatron"`` (``"dp"`` where t = 1) on ``{data: d, model: t}``.
* **auto, paper's mesh**: the same (t, p, d), the ILP's layouts inside a stage, every schedule
  (GPipe, 1F1B, eager 1F1B, interleaved V in {2, 4}), 1 or 2 sequences per data shard per
  microbatch. p = 1 rows: ``strategy="auto"`` on the paper's mesh.
* **auto, mesh left open**: the row's GPU count alone. Pipelined rows: every stage count S >= 2
  and tensor size T in {4, 8} (within a node) whose parameters and Adam state fit, with the
  same schedules and microbatches. p = 1 rows: ``autopar.plan(mesh=gpus)``, which plans every
  {data, model} shape whose model axis divides a node.

TFLOP/s per GPU are counted as Megatron-LM counts them (its equation 3, recomputation
included): ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` per step, over the predicted step
and the GPU count. Every figure is a prediction of this project's cost model; the paper's
column is the only measured one.

    python benchmarks/megatron_table.py          # 1.7B-310.1B (~25 min on 2 cores)
    python benchmarks/megatron_table.py --all    # also 529.6B and 1T
    python benchmarks/megatron_table.py --quick  # the 39.1B row, paper's mesh only

Writes ``benchmarks/results/megatron_table.md`` and ``megatron_table.csv``.
"""
from __future__ import annotations

import time

import _common
import jax.numpy as jnp
import pipeline_3d

import autopar
import cost_models
from autopar.models import gpt
from autopar.pipeline import schedules as S
from autopar.pipeline.megatron_3d import stage_layouts

SEQ, VOCAB = 2048, 51200
# (name, heads, d_model, layers, t, p, GPUs, global batch, TFLOP/s per GPU measured): Table 1
PAPER = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
DEFAULT_ROWS = 8          # through 310.1B; --all adds the last two
SUB_PLAN_LIMIT_S = 1.0
PLAN_LIMIT_S = 10.0
# megatron_3d as the strategy runs it: asynchronously (MPMD) with one chunk per stage, as
# Megatron-LM does; its interleaved chunks on the lockstep runtime (mpmd.supports)
HAND = dict(tensor=None, rows_per_shard=(1,), schedules=("1f1b",), virtual=(1, 2),
            runtimes=("mpmd",))
AUTO = dict(tensor=None, rows_per_shard=(1, 2), schedules=S.ALL, virtual=(1, 2, 4))
OPEN_TENSOR = (4, 8)
HEADER = ("row", "gpus", "paper t p d", "batch", "paper TFLOP/s",
          "megatron_3d TFLOP/s", "megatron_3d / paper", "megatron_3d schedule, M, bubble",
          "auto TFLOP/s", "auto / paper", "auto schedule, M, bubble",
          "open mesh TFLOP/s", "open / paper", "open mesh choice", "plan_s")


NOTES = """\
Reading the table:

* megatron_3d runs as Megatron-LM runs it: 1F1B issued asynchronously, each stage its own
  programs (``autopar.pipeline.mpmd``). On the lockstep runtime (one SPMD program, every hop
  between stages a tick) its plain 1F1B had 38% and 53% bubbles at p = 4 and 16 and reached
  0.53-0.94x of the paper. The predicted bubbles here exceed the textbook (p - 1) / M: the
  last stage's forward is free (its backward recomputes it), the embedding and head make the
  end stages longer, and every hop and issued action costs time. Auto adds eager 1F1B,
  ZB-H1 (each layer's backward split into its input and weight halves, the weight halves
  deferred into 1F1B's idle time: ``autopar.pipeline.split``), two sequences per microbatch
  and the ILP's layouts inside a stage. ZB-H1 holds each deferred microbatch's frontier (what
  the weight half reads), so it wins only where that fits beside the rest.
* megatron_3d splits the embedding and the output layer over the vocabulary, as Megatron-LM
  does. Kept whole (before that was fixed) they put its best candidates at 80.6 GiB (145.6B)
  and 94.5 GiB (310.1B): no plan fitted 80 GiB.
* The p = 1 rows are not pipelined: the whole batch is one step (Megatron-LM accumulates
  microbatches); their ratios are the intra-operator cost model's against the paper's
  measurement.
"""


def config(heads: int, d_model: int, layers: int) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab=VOCAB, seq=SEQ, d_model=d_model, heads=heads, d_ff=4 * d_model,
                         layers=layers, scan=True, remat=True, dtype=jnp.bfloat16)


def flops_per_step(batch: int, layers: int, d_model: int) -> float:
    """Megatron-LM's count (SC'21, eq. 3), with the forward recomputed once."""
    h, s, lyr = d_model, SEQ, layers
    return 96 * batch * s * lyr * h * h * (1 + s / (6 * h) + VOCAB / (16 * lyr * h))


def _pipelined(staged, batch: int, hw, sizes_of, grid: dict, costs: dict, strategy):
    """The best pipeline choice over the meshes ``sizes_of`` yields (``pipeline_3d.choices_on``
    on each) for ``staged`` (``pipeline_3d.abstract_staged``), with stage costs under
    ``strategy``."""
    model, params, xb = staged
    if strategy == "megatron":
        strategy = stage_layouts(model, params, xb)
    out = []
    for sizes in sizes_of(model):
        out += pipeline_3d.choices_on(model, params, xb, sizes, hw, hw.memory_bytes, grid,
                                      costs, batch, SUB_PLAN_LIMIT_S, strategy)
    return pipeline_3d.search.best(out, hw.memory_bytes)


def _pipe_cells(choice, flops: float, gpus: int, paper: float, mesh: bool = False):
    if choice is None:
        return ("-", "-", "no plan fits" + (" (mesh)" if mesh else ""))
    p = choice.plan
    tf = flops / p.step_time_s / gpus / 1e12
    what = (f"{p.schedule} V={p.virtual_stages}, M={p.microbatches}, {p.bubble_fraction:.0%}, "
            f"{p.runtime}")
    if mesh:
        what = f"{_common.mesh_str(choice.sizes)}: {what}"
    return (tf, tf / paper, what)


def _flat_cells(plan, flops: float, gpus: int, paper: float, mesh: bool = False):
    if isinstance(plan, str):
        return ("-", "-", plan)
    tf = flops / plan.cost.step_time_s / gpus / 1e12
    what = f"not pipelined, peak {plan.cost.peak_memory_bytes / 2**30:.0f} GiB"
    if mesh:
        what = f"{_common.mesh_str(dict(plan.mesh))}: {what}"
    return (tf, tf / paper, what)


def _flat_plan(cfg, batch: int, mesh, strategy: str):
    fn, state, xb = gpt.abstract(cfg, batch)
    try:
        return autopar.plan(fn, state, xb, mesh=mesh, hardware="a100", strategy=strategy,
                            time_limit_s=PLAN_LIMIT_S, memory_decisions=())
    except autopar.AutoparError as e:
        return f"no plan: {type(e).__name__}"


def run_row(row, open_mesh: bool = True) -> tuple:
    name, heads, d_model, layers, t, p, gpus, batch, paper = row
    hw = cost_models.hardware("a100")
    cfg = config(heads, d_model, layers)
    flops = flops_per_step(batch, layers, d_model)
    d = gpus // (t * p)
    t0 = time.perf_counter()
    if p == 1:
        mesh = {"data": d, "model": t} if t > 1 else {"data": d}
        hand = _flat_cells(_flat_plan(cfg, batch, mesh, "megatron" if t > 1 else "dp"),
                           flops, gpus, paper)
        auto = _flat_cells(_flat_plan(cfg, batch, mesh, "auto"), flops, gpus, paper)
        free = (_flat_cells(_flat_plan(cfg, batch, gpus, "auto"), flops, gpus, paper, True)
                if open_mesh else ("-", "-", "not run"))
    else:
        costs: dict = {}
        staged = pipeline_3d.abstract_staged(cfg, batch)
        paper_mesh = lambda model: [{"stage": p, "data": d, "model": t}]   # noqa: E731
        hand = _pipe_cells(_pipelined(staged, batch, hw, paper_mesh, HAND, {}, "megatron"),
                           flops, gpus, paper)
        auto = _pipe_cells(_pipelined(staged, batch, hw, paper_mesh, AUTO, costs, "auto"),
                           flops, gpus, paper)
        if open_mesh:
            def meshes(model):
                return [s for s in pipeline_3d.search.meshes(
                    gpus, model.num_layers, hw.devices_per_node, OPEN_TENSOR)
                    if model.num_layers % s["stage"] == 0]
            free = _pipe_cells(_pipelined(staged, batch, hw, meshes, AUTO, costs, "auto"),
                               flops, gpus, paper, True)
        else:
            free = ("-", "-", "not run")
    spent = time.perf_counter() - t0
    out = (name, gpus, f"{t} {p} {d}", batch, float(paper), *hand, *auto, *free, spent)
    print(" | ".join(_common._cell(x) for x in out), flush=True)
    return out


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--all", action="store_true", help="also the 529.6B and 1T rows")
    args = parser.parse_args()
    out = _common.out_dir(args)
    rows = [PAPER[4]] if args.quick else PAPER if args.all else PAPER[:DEFAULT_ROWS]
    t0 = time.perf_counter()
    table = [run_row(r, open_mesh=not args.quick) for r in rows]
    _common.write_csv(out / "megatron_table.csv", HEADER, table)
    text = ["# Megatron-LM's SC'21 table, planned (predicted TFLOP/s per GPU)", "",
            __doc__.split("\n\n", 1)[1].split("    python ")[0].strip(), "",
            _common.md_table(HEADER, table), "", NOTES, "",
            f"Wall time {time.perf_counter() - t0:.0f} s. Environment: "
            f"{_common.environment()}.", ""]
    _common.write_md(args, "megatron_table.md", "\n".join(text))


if __name__ == "__main__":
    main()
