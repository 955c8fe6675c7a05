"""The mesh's shape as a decision, measured: every shape ``mesh=8`` plans, timed side by side.

``autopar.plan(step, ..., mesh=jax.devices())`` (as ``mesh=8``) plans every {data, model}
shape of the 8 CPU devices and keeps the fastest predicted (``Plan.mesh_candidates``). Here
each candidate shape's plan is also compiled and timed, in interleaved rounds (each executable
once per round, medians), on models this project did not write (``benchmarks/zoo.py``'s Flax
NNX, MaxText-style linen and Equinox LMs and transformers' GPT-2, Llama and BERT, plain steps),
so the choice is held to the measured best shape. Predicted by the CPU profile; measured on the
8 emulated CPU devices.

    python benchmarks/mesh_choice.py          # six models (~3 min on 2 cores)
    python benchmarks/mesh_choice.py --quick  # one small model on 4 devices

Writes ``benchmarks/results/mesh_choice.md`` and ``mesh_choice.csv``.
"""
from __future__ import annotations

import statistics
import time

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import zoo as Z  # noqa: E402

import autopar  # noqa: E402
from autopar import mesh_search  # noqa: E402

DEVICES = 8
RUNS = 21
MODELS = ("nnx_lm", "linen_lm", "eqx_lm", "gpt2", "llama", "bert")
HEADER = ("model", "mesh", "chosen", "pred_ms", "meas_ms", "pred/meas", "pred rank",
          "meas rank", "same_program")


def _cases(quick: bool) -> list:
    if quick:
        return Z.cases(True)
    seen, out = set(), []
    for c in Z.cases(False):
        if c.step == "plain" and c.name in MODELS and c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out


def run_case(case, runs: int, limit_s: float = Z.TIME_LIMIT_S,
             devices: int = DEVICES) -> list[dict]:
    fn, args = case.build()
    # the devices themselves (a list): their profile prices the plans, as mesh=8 does on 8
    chosen = autopar.plan(fn, *args, mesh=jax.devices()[:devices], time_limit_s=limit_s)
    cands = [c for c in chosen.mesh_candidates if c.step_time_s is not None]
    plans, exes = {}, {}
    for c in cands:
        sizes = dict(c.mesh)
        mesh = mesh_search.concrete(jax.devices()[:devices], sizes)   # as autoparallel makes it
        plan = chosen if sizes == dict(chosen.mesh) else autopar.plan(
            fn, *args, mesh=mesh, time_limit_s=limit_s)
        name = _common.mesh_str(sizes)
        plans[name] = (plan, c)
        exe = autopar.autoparallel(fn, mesh=mesh, plan=plan).lower(*Z._shapes(args)).compile()
        exes[name] = (exe, jax.device_put(args, exe.input_shardings[0]))
    measured = Z._timed(exes, runs)
    meas_rank = {k: i + 1 for i, k in enumerate(sorted(measured, key=lambda k: measured[k][0]))}
    rows = []
    for i, (name, (plan, cand)) in enumerate(plans.items()):
        t, same = measured[name]
        pred = cand.step_time_s * 1e3
        rows.append({"model": case.name, "mesh": name,
                     "chosen": "yes" if plan is chosen else "",
                     "pred_ms": pred, "meas_ms": t * 1e3, "pred/meas": pred / (t * 1e3),
                     "pred rank": i + 1, "meas rank": meas_rank[name],
                     "same_program": same if same != name else "-"})
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per model: the chosen shape's measured time against the measured best shape's."""
    out, ratios = [], []
    for model in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == model]
        pick = next(r for r in group if r["chosen"])
        best = min(group, key=lambda r: r["meas_ms"])
        ratio = best["meas_ms"] / pick["meas_ms"]
        ratios.append(ratio)
        out.append(f"- {model}: chose {pick['mesh']} ({pick['meas_ms']:.2f} ms measured); "
                   f"measured best {best['mesh']} ({best['meas_ms']:.2f} ms): "
                   f"{ratio:.3f}x of the best")
    if ratios:
        within = sum(r >= 0.95 for r in ratios)
        out.insert(0, f"Chosen shape against the measured best shape: median "
                      f"{statistics.median(ratios):.3f}x, min {min(ratios):.3f}x; within 5% "
                      f"on {within} of {len(ratios)} models.")
    return out


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    out = _common.out_dir(args)
    runs = 2 if args.quick else RUNS
    t0 = time.perf_counter()
    rows = []
    for case in _cases(args.quick):
        # --quick: 4 devices (3 shapes), a 2 s limit: the smoke test's share of the suite
        got = (run_case(case, runs, 2.0, devices=4) if args.quick
               else run_case(case, runs))
        rows += got
        for r in got:
            print(" | ".join(_common._cell(r[h]) for h in HEADER), flush=True)
    table = [[r[h] for h in HEADER] for r in rows]
    _common.write_csv(out / "mesh_choice.csv", HEADER, table)
    text = ["# The mesh's shape as a decision, measured", "",
            __doc__.split("\n\n", 1)[1].split("    python ")[0].strip(), "",
            *summary(rows), "", _common.md_table(HEADER, table), "",
            "pred rank: the shape's place among the candidates by predicted step (1 = chosen); "
            "meas rank: by measured step. same_program: shapes whose plans compile to the same "
            "program are timed once.", "",
            f"Wall time {time.perf_counter() - t0:.0f} s, {runs} rounds. Environment: "
            f"{_common.environment()}.", "",
            "Reproduce: `python benchmarks/mesh_choice.py`.", ""]
    _common.write_md(args, "mesh_choice.md", "\n".join(text))


if __name__ == "__main__":
    main()
