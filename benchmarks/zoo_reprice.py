"""Does a recalibrated CPU collective model rank the zoo's plans better? An ablation of the
figures ``cost_models/profiles/cpu.json`` prices collectives with, against the zoo's measured
steps.

``benchmarks/results/zoo.csv`` holds, per model, step and mesh, every hand-written strategy's
(and the user's layout's) measured step. Here each is planned again (``autopar.compare``,
``measure=False``) under variants of the CPU profile, and the plan the variant predicts fastest
is scored by what it measured: measured best of the case / measured step of that pick (1.0: the
variant ranks the measured best first). Variants:

  * ``profile``: ``cpu.json`` as shipped (``collective_launch_s`` 0.17 ms, measured at load ~11);
  * ``launch 0.04 ms`` and ``launch 0.012 ms``: the in-program launch, the second what
    ``cost_models.measure.measure_collective_chain`` gives at load ~1 (slope of a chain of
    dependent all-reduces over 8 devices, less its ring steps);
  * ``no combine refund``: the profile, but XLA's all-reduce combiner saves no launch (on
    XLA:CPU a combined all-reduce of K operands costs what K dependent ones do: the
    microbenchmark below).

Then the microbenchmark: K all-reduces of 64 KiB in all over 8, 4 (``model``) and 2 (``data``)
devices of a 2 x 4 mesh, independent (XLA combines them into one) or chained (it cannot).

    python benchmarks/zoo_reprice.py            # every zoo case (about 25 min on 2 cores)
    python benchmarks/zoo_reprice.py --quick    # one case, the shipped profile

Writes ``benchmarks/results/zoo_reprice.md``.
"""
from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import statistics
import warnings

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import zoo  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autopar  # noqa: E402
from autopar.planner import combine  # noqa: E402
from cost_models.hardware import hardware  # noqa: E402
from cost_models.measure import median_time_s  # noqa: E402

VARIANTS = {
    "profile": dict(),
    "launch 0.04 ms": dict(collective_launch_s=4e-5),
    "launch 0.012 ms": dict(collective_launch_s=1.2e-5),
    "no combine refund": dict(refund=False),
}


def _measured() -> dict:
    out = collections.defaultdict(dict)
    with open(_common.RESULTS / "zoo.csv") as f:
        for r in csv.DictReader(f):
            if r["meas_ms"] not in ("-", ""):
                out[(r["model"], r["step"], r["mesh"])][r["strategy"]] = float(r["meas_ms"])
    return out


@functools.cache
def _hardware(name: str):
    kw = {k: v for k, v in VARIANTS[name].items() if k != "refund"}
    return dataclasses.replace(hardware("cpu"), **kw)


def _predicted(case, sizes, variant: str) -> dict:
    mesh = zoo._mesh(sizes)
    fn, args = case.build()
    user = case.user_layout(mesh) if case.user_layout else None
    strategies = list(zoo.HAND) + ([autopar.strategies.user(user, name="user")]
                                   if user is not None else [])
    refund = VARIANTS[variant].get("refund", True)
    saved = combine.launch_refund_s, combine.launch_terms
    if not refund:
        combine.launch_refund_s = lambda *a, **k: 0.0
        combine.launch_terms = lambda *a, **k: {}
    try:
        cmp = autopar.compare(fn, *args, mesh=mesh, hardware=_hardware(variant), measure=False,
                              progress=False, strategies=tuple(strategies),
                              time_limit_s=zoo.TIME_LIMIT_S)
    finally:
        combine.launch_refund_s, combine.launch_terms = saved
    return {r.strategy: r.plan.cost.step_time_s * 1e3 for r in cmp.rows if r.ok}


def _all_reduces(k: int, axes, chained: bool) -> float:
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    n = (64 << 10) // 4 // k
    spec = P(("data", "model"))
    xs = [jax.device_put(jnp.ones((8, n), jnp.float32), NamedSharding(mesh, spec))
          for _ in range(k)]

    def body(xs):
        out, c = [], 0.0
        for x in xs:
            y = jax.lax.psum(x * 1.0001 + (c if chained else 0.0), axes)
            out.append(y)
            c = y[0, 0] * 1e-9
        return out

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return median_time_s(fn, (xs,), repeats=30, warmup=3) * 1e3


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    warnings.filterwarnings("ignore")
    measured = _measured()
    cases = zoo.cases(False)[:1] if args.quick else zoo.cases(False)
    variants = ["profile"] if args.quick else list(VARIANTS)
    rows, scores = [], collections.defaultdict(list)
    for case in cases:
        for sizes in (zoo.MESHES[1:] if args.quick else zoo.MESHES):
            key = (case.name, case.step, _common.mesh_str(sizes))
            meas = measured.get(key)
            if not meas:
                continue
            best = min(meas.values())
            for v in variants:
                pred = _predicted(case, sizes, v)
                pick = min((s for s in pred if s in meas), key=lambda s: pred[s])
                scores[v].append(best / meas[pick])
                rows.append((*key, v, pick, pred[pick], meas[pick], best / meas[pick]))
                print("  " + "  ".join(_common._cell(x) for x in rows[-1]), flush=True)
    micro = []
    for axes, label in ((("data", "model"), "8"), ("model", "4"), ("data", "2")):
        for k in (1, 8, 32):
            micro.append((label, k, _all_reduces(k, axes, False), _all_reduces(k, axes, True)))
    summary = [(v, len(s), statistics.median(s), min(s), sum(x >= 0.95 for x in s))
               for v, s in scores.items()]
    text = "\n".join([
        "# The CPU collective model, recalibrated: does it rank the zoo better?", "",
        f"{_common.environment()}.", "",
        "Scored against the measured steps of [zoo.md](zoo.md) (its commit and load). Per case: "
        "the plan the variant predicts fastest among the hand-written strategies and the "
        "user's layout, measured best / its measured step. Reproduce: "
        "`python benchmarks/zoo_reprice.py`.", "",
        _common.md_table(("variant", "cases", "median score", "min score",
                          "cases within 5% of the measured best"), summary), "",
        "## All-reduces on the 8 emulated CPU devices", "",
        "64 KiB in all, split into K operands; independent (XLA combines them into one "
        "all-reduce) or chained (each waits for the last: K all-reduces). Medians of 30.", "",
        _common.md_table(("devices", "K", "independent (combined) ms", "chained ms"), micro), "",
        "## Every case", "",
        _common.md_table(("model", "step", "mesh", "variant", "pick", "pick pred ms",
                          "pick meas ms", "score"), rows), ""])
    _common.write_md(args, "zoo_reprice.md", text)


if __name__ == "__main__":
    main()
