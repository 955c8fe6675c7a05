"""Auto against every hand-written strategy and the user's own layout, on models this project
did not write: predicted and measured side by side on 8 emulated CPU devices.

Models (``autopar.models.zoo`` and transformers' own Flax models, random weights): Flax NNX,
MaxText-style Flax linen (logical axis rules: the user's own layout is its ``in_shardings``,
run by plain ``jax.jit`` under the mesh with its ``nn.with_logical_constraint`` calls active),
Equinox, and transformers' GPT-2, Llama and Mistral (decoders; Mistral with grouped-query
attention and a sliding window), BERT (encoder), T5 and BART (encoder-decoders), ViT (vision)
and Whisper (speech: a convolutional front end and an encoder-decoder); plain steps, gradient
accumulation over microbatches in a ``lax.scan``, and bf16 mixed precision (float32 master weights).

On each mesh ({data: 8} and {data: 2, model: 4}) every hand-written strategy is planned
(``autopar.compare(..., measure=False)``), then auto seeded (compare's rows handed to it) and
unseeded (``autopar.plan(strategy="auto")``), and auto tuned (``autoparallel(tune=True)``:
its near-equal candidates timed in its own rounds, the fastest kept). Every plan is compiled
with autopar's codegen and, with the user's own ``jax.jit``, timed in interleaved rounds (each
executable once per round, after a warm-up round, the order rotated each round; medians), so
every row of a model sees the same load. Reported per row:
predicted and measured step, the cost model's error (predicted / measured), and per model and
mesh auto's predicted and measured ratio against the best other plan.

    python benchmarks/zoo.py                 # every model, both meshes (about 40 min on 2 cores)
    python benchmarks/zoo.py --quick         # one tiny model, one mesh
    python benchmarks/zoo.py --only nnx_lm   # some models, results merged into the files
    python benchmarks/zoo.py --check-plans   # plan only (5 min): which rows' predicted steps
                                             # differ from the committed zoo.csv (with --only:
                                             # those models' rows)

Writes ``benchmarks/results/zoo.md`` and ``zoo.csv``.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import re
import statistics
import time

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autopar  # noqa: E402
import cost_models  # noqa: E402
from autopar import tune  # noqa: E402
from autopar.models import hf, zoo  # noqa: E402

HAND = ("dp", "zero1", "zero2", "zero3", "megatron", "megatron_sp", "fsdp_tp")
MESHES = ({"data": 8}, {"data": 2, "model": 4})
HEADER = ("model", "framework", "step", "mesh", "strategy", "pred_ms", "meas_ms", "pred/meas",
          "pred_peak_mib", "same_program", "status")
TIME_LIMIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    framework: str
    step: str                       # plain, accum4, bf16
    build: object                   # () -> (fn, args tuple)
    user_layout: object = None      # mesh -> in_shardings (the model's own), or None


def _zoo(maker, cfg):
    def build():
        fn, *args = maker(cfg)
        return fn, tuple(args)
    return build


def _hf(name, **kw):
    def build():
        fn, state, batch = hf.concrete(name, hf.tiny(name, **kw), 16)
        return fn, (state, batch)
    return build


def cases(quick: bool) -> list[Case]:
    base = zoo.Config(batch=16)
    if quick:
        return [Case("nnx_lm", "flax.nnx", "plain", _zoo(zoo.nnx_lm, zoo.Config(layers=1)))]
    lin = dataclasses.replace(base)
    return [
        Case("nnx_lm", "flax.nnx", "plain", _zoo(zoo.nnx_lm, base)),
        Case("nnx_lm", "flax.nnx", "accum4", _zoo(zoo.nnx_lm, dataclasses.replace(base,
                                                                                 accum=4))),
        Case("nnx_lm", "flax.nnx", "bf16", _zoo(zoo.nnx_lm, dataclasses.replace(
            base, dtype=jnp.bfloat16))),
        Case("linen_lm", "flax.linen+rules", "plain", _zoo(zoo.linen_lm, lin),
             lambda mesh: zoo.linen_user_layout(lin, mesh)),
        Case("linen_lm", "flax.linen+rules", "bf16",
             _zoo(zoo.linen_lm, dataclasses.replace(lin, dtype=jnp.bfloat16)),
             lambda mesh: zoo.linen_user_layout(dataclasses.replace(lin, dtype=jnp.bfloat16),
                                                mesh)),
        Case("eqx_lm", "equinox", "plain", _zoo(zoo.eqx_lm, base)),
        Case("eqx_lm", "equinox", "accum4", _zoo(zoo.eqx_lm, dataclasses.replace(base,
                                                                                 accum=4))),
        Case("gpt2", "transformers", "plain", _hf("gpt2")),
        Case("llama", "transformers", "plain", _hf("llama")),
        Case("bert", "transformers", "plain", _hf("bert")),
        Case("t5", "transformers", "plain", _hf("t5")),
        Case("bart", "transformers", "plain", _hf("bart")),
        Case("mistral", "transformers", "plain", _hf("mistral")),
        Case("vit", "transformers", "plain", _hf("vit")),
        Case("whisper", "transformers", "plain", _hf("whisper")),
    ]


def _mesh(sizes: dict):
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _shapes(args):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


def _plans(case: Case, fn, args, mesh, hand=HAND, tuned: bool = False) -> dict:
    """name -> plan: the hand-written strategies, the user's layout, auto seeded and unseeded,
    and (``tuned``) the plan a step decorated ``autoparallel(tune=True)`` chose by timing its
    near-equal candidates in its own rounds (``autopar.tune``), before the zoo's rounds time
    it again beside the others."""
    strategies = list(hand)
    user = case.user_layout(mesh) if case.user_layout else None
    if user is not None:
        strategies.append(autopar.strategies.user(user, name="user"))
    strategies.append("auto")
    cmp = autopar.compare(fn, *args, mesh=mesh, measure=False, progress=False,
                          strategies=tuple(strategies), time_limit_s=TIME_LIMIT_S)
    plans = {r.strategy: r.plan for r in cmp.rows if r.ok}
    # unseeded: autopar.plan on the arguments as the user holds them (committed to their own
    # layout where they have one, which autopar.plan then holds auto against)
    held = args if user is None else jax.device_put(args, user)
    plans["auto-unseeded"] = autopar.plan(fn, *held, mesh=mesh, time_limit_s=TIME_LIMIT_S)
    if tuned:
        step = autopar.autoparallel(fn, mesh=mesh, tune=True, time_limit_s=TIME_LIMIT_S)
        step.compile(*held)         # arrays: tuned on them, nothing donated
        plans["auto-tuned"] = step.plan
    return plans


def _executables(fn, args, mesh, plans: dict, user) -> dict:
    """name -> (compiled, placed args): autopar's codegen for each plan, plain jax.jit for the
    user's own layout (under the mesh, so flax's logical constraints are in force)."""
    out = {}
    for name, plan in plans.items():
        exe = autopar.autoparallel(fn, mesh=mesh, plan=plan).lower(*_shapes(args)).compile()
        out[name] = (exe, jax.device_put(args, exe.input_shardings[0]))
    if user is not None:
        with jax.set_mesh(mesh):
            exe = jax.jit(fn, in_shardings=user).lower(*_shapes(args)).compile()
        out["user-jit"] = (exe, jax.device_put(args, exe.input_shardings[0]))
    return out


def _programs(exes: dict) -> dict:
    """name -> the first name whose compiled program is the same (equal HLO text): plans that
    decide the same layouts (auto returning dp's plan) are one executable, timed once, so their
    rows differ by nothing, not by the machine's noise."""
    first: dict[int, str] = {}
    return {k: first.setdefault(hash(_program_text(exe)), k) for k, (exe, _) in exes.items()}


def _program_text(exe) -> str:
    """``exe``'s HLO text without its source metadata (the Python lines it was traced from,
    which differ between two compiles of one plan and change nothing that runs)."""
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", exe.as_text())
    return "\n".join(ln for ln in text.splitlines() if not _LOCATION.match(ln))


_LOCATION = re.compile(r"\s*\d+ \{(file_name_id|function_name_id|file_location_id)=")


def _timed(exes: dict, runs: int) -> dict:
    """Median seconds per executable over ``runs`` interleaved rounds (after a warm-up), the
    order rotated each round (``autopar.tune.interleaved``, as a tuned step times its
    candidates: the executable timed right after another measures slower on the CPU devices);
    an executable whose program another already has gets that one's times."""
    same = _programs(exes)

    def run(k):
        exe, placed = exes[k]
        t0 = time.perf_counter()
        jax.block_until_ready(exe(*placed))
        return time.perf_counter() - t0

    medians = tune.interleaved({k: functools.partial(run, k) for k in exes if same[k] == k}, runs)
    return {k: (medians[same[k]], same[k]) for k in exes}


def run_case(case: Case, sizes: dict, runs: int, hand=HAND, tuned: bool = True) -> list[dict]:
    mesh = _mesh(sizes)
    fn, args = case.build()
    user = case.user_layout(mesh) if case.user_layout else None
    # A model with the user's own layout (MaxText-style linen) is planned and compiled inside
    # the mesh, as its user runs it: flax's logical constraints are then part of the step
    # (the user's layout keeps them; auto takes them as hints).
    with jax.set_mesh(mesh) if user is not None else contextlib.nullcontext():
        plans = _plans(case, fn, args, mesh, hand, tuned=tuned)
        exes = _executables(fn, args, mesh, plans, user)
    measured = _timed(exes, runs)
    rows = []
    for name, (t, same) in measured.items():
        plan = plans.get(name)
        pred = plan.cost.step_time_s * 1e3 if plan is not None else float("nan")
        rows.append(dict(model=case.name, framework=case.framework, step=case.step,
                         mesh=_common.mesh_str(sizes), strategy=name, pred_ms=pred,
                         meas_ms=t * 1e3, **{"pred/meas": pred / (t * 1e3)},
                         pred_peak_mib=(plan.cost.peak_memory_bytes / 2**20 if plan is not None
                                        else float("nan")),
                         same_program=same if same != name else "-",
                         status=plan.solver.status[:60] if plan is not None else "jax.jit"))
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per model and mesh: auto's predicted and measured ratio against the best other row
    (>= 1 means auto is at least as fast), and whether the cost model ranked auto first or within
    5% of the measured best."""
    out = []
    for key in dict.fromkeys((r["model"], r["step"], r["mesh"]) for r in rows):
        group = [r for r in rows if (r["model"], r["step"], r["mesh"]) == key]
        by = {r["strategy"]: r for r in group}
        for auto in ("auto", "auto-unseeded", "auto-tuned"):
            if auto not in by:
                continue
            others = [r for r in group if not r["strategy"].startswith("auto")]
            pred_best = min((r for r in others if r["pred_ms"] == r["pred_ms"]),
                            key=lambda r: r["pred_ms"])
            meas_best = min(group, key=lambda r: r["meas_ms"])
            meas_other = min(others, key=lambda r: r["meas_ms"])
            a = by[auto]
            out.append(dict(model=key[0], step=key[1], mesh=key[2], auto=auto,
                            pred_ratio=pred_best["pred_ms"] / a["pred_ms"],
                            pred_best=pred_best["strategy"],
                            meas_ratio=meas_other["meas_ms"] / a["meas_ms"],
                            meas_best=meas_other["strategy"],
                            ranked_ok=a["meas_ms"] <= 1.05 * meas_best["meas_ms"],
                            error=statistics.median(abs(r["pred/meas"] - 1) for r in group
                                                    if r["pred/meas"] == r["pred/meas"])))
    return out


def report(rows: list[dict], summ: list[dict]) -> str:
    seeded = [s for s in summ if s["auto"] == "auto"]
    unseeded = [s for s in summ if s["auto"] == "auto-unseeded"]
    tuned = [s for s in summ if s["auto"] == "auto-tuned"]
    lines = [
        "# Auto on models this project did not write (zoo)", "",
        f"{_common.environment()}.", "",
        "Each model on each mesh: every hand-written strategy, the user's own layout (linen: its "
        "logical rules, as `user` planned by autopar and as `user-jit`, the user's own "
        "`jax.jit`), auto seeded (`compare`'s rows handed to it) and unseeded "
        "(`autopar.plan`), and auto tuned (`autoparallel(tune=True)`: the plans predicted "
        f"within {tune.band(cost_models.hardware('cpu')):.0%} of auto's (the CPU profile's "
        "measured ranking error) timed in the step's own rounds, the fastest kept; its predicted "
        "step is the chosen plan's, which may exceed auto's). Predicted by the CPU cost model; "
        "measured on 8 emulated CPU devices in interleaved rounds (medians, the order rotated "
        "each round). Plans that compile to the same program (equal HLO "
        "text: auto returning dp's plan) are one executable, timed once (`same_program` names "
        "the row it shares). Reproduce: `python benchmarks/zoo.py`.", "",
        "## Targets", "",
        _targets(seeded, "auto (seeded)"), _targets(unseeded, "auto (unseeded)"),
        _targets(tuned, "auto (tuned: `autoparallel(tune=True)`)"), "",
        "## Auto against the best other plan, per model and mesh", "",
        _common.md_table(("model", "step", "mesh", "auto", "pred best other / auto",
                          "best other (pred)", "meas best other / auto", "best other (meas)",
                          "auto within 5% of meas best", "median |pred/meas - 1|"),
                         [(s["model"], s["step"], s["mesh"], s["auto"], s["pred_ratio"],
                           s["pred_best"], s["meas_ratio"], s["meas_best"],
                           "yes" if s["ranked_ok"] else "no", s["error"]) for s in summ]), "",
        "## Every plan", "",
        _common.md_table(HEADER, [[r[h] for h in HEADER] for r in rows]), ""]
    return "\n".join(lines)


def _targets(summ: list[dict], label: str) -> str:
    if not summ:
        return f"- {label}: no rows"
    pred = [s["pred_ratio"] for s in summ]
    meas = [s["meas_ratio"] for s in summ]
    ranked = sum(s["ranked_ok"] for s in summ)
    wins = sum(p >= 1 - 1e-9 for p in pred)
    return (f"- {label}: predicted >= 1.00x the best other plan on {wins} of {len(pred)} rows "
            f"(min {min(pred):.3f}); measured against the best other plan: "
            f"median {statistics.median(meas):.3f}x, min {min(meas):.3f}x; within 5% of the "
            f"measured best on {ranked} of {len(summ)} rows ({ranked / len(summ):.0%})")


def check_plans(csv_path, only=None) -> int:
    """Plan every row again (of the models ``only`` names, or all), measure nothing, and print
    the rows whose predicted step differs from ``csv_path``'s by more than 0.1%: whether a
    planner change leaves the committed measurements describing the plans it makes now.
    Returns how many differ."""
    with open(csv_path) as f:
        old = {(r["model"], r["step"], r["mesh"], r["strategy"]): r["pred_ms"]
               for r in csv.DictReader(f)}
    changed, total = [], 0
    for case in cases(False):
        if only and case.name not in only:
            continue
        fn, args = case.build()
        for sizes in MESHES:
            for name, plan in _plans(case, fn, args, _mesh(sizes)).items():
                key = (case.name, case.step, _common.mesh_str(sizes), name)
                new = plan.cost.step_time_s * 1e3
                was = old.get(key, "-")
                total += 1
                if was in ("-", "") or abs(new / float(was) - 1) > 1e-3:
                    changed.append(f"{' '.join(key)}: {was} -> {new:.4f} ms")
    print(f"{len(changed)} of {total} rows' predicted steps differ from {csv_path.name}")
    print("\n".join(changed))
    return len(changed)


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--only", nargs="*", default=None, help="model names to run (merged)")
    p.add_argument("--runs", type=int, default=21)
    p.add_argument("--check-plans", action="store_true",
                   help="plan only; list rows whose predicted step differs from zoo.csv")
    args = p.parse_args()
    if args.check_plans:
        raise SystemExit(1 if check_plans(_common.out_dir(args) / "zoo.csv", args.only) else 0)
    runs = 2 if args.quick else args.runs
    meshes = MESHES[1:] if args.quick else MESHES
    out = _common.out_dir(args)
    old = []
    csv_path = out / "zoo.csv"
    if args.only and csv_path.exists():
        with open(csv_path) as f:
            old = [r for r in csv.DictReader(f) if r["model"] not in args.only]
            for r in old:
                r.setdefault("same_program", "-")
                for k in ("pred_ms", "meas_ms", "pred/meas", "pred_peak_mib"):
                    r[k] = float(r[k]) if r[k] not in ("-", "") else float("nan")
    rows = list(old)
    for case in cases(args.quick):
        if args.only and case.name not in args.only:
            continue
        for sizes in meshes:
            t0 = time.perf_counter()
            # --quick (the test suite's smoke run) leaves the tuned row out: tuning plans and
            # compiles every near candidate again, and tests/test_tune.py covers it
            rows += run_case(case, sizes, runs, ("dp", "megatron") if args.quick else HAND,
                             tuned=not args.quick)
            print(f"{case.name} {case.step} {_common.mesh_str(sizes)}: "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    _common.write_csv(csv_path, HEADER, [[r[h] for h in HEADER] for r in rows])
    _common.write_md(args, "zoo.md", report(rows, summary(rows)))


if __name__ == "__main__":
    main()
