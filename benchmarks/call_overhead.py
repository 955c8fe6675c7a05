"""What calling an autoparallel step costs on top of its compiled program, on 8 CPU devices.

The zoo's linen LM measured 15-18% slower through autopar than under the user's own
``jax.jit``, although both compiled the same HLO: the difference was autopar's per-call Python
(parting the arguments, checking every leaf and building its path and dtype name for messages,
about 20 us a leaf). A step called again with arrays of a signature it has run now takes a
shortcut (``AutoParallel._fast_hit``). Per model, timed in interleaved rounds (medians), the
same executable three ways:

  * ``raw``: jax's compiled program called on arguments already in its layouts (no autopar);
  * ``step``: the autoparallel step called as users call it (the shortcut);
  * ``whole path``: the same, with the shortcut's table emptied before each call (the path
    every call took before it).

Models from ``autopar.models.zoo`` (Flax linen with logical rules, Flax NNX split
functionally, Equinox partitioned), 2 layers, batch 16, ``strategy="dp"`` on {data: 8}.

    python benchmarks/call_overhead.py [--runs 41]

Writes ``benchmarks/results/call_overhead.md``.
"""
from __future__ import annotations

import statistics
import time

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
import jax  # noqa: E402

import autopar  # noqa: E402
from autopar.models import zoo  # noqa: E402

MODELS = (("linen_lm", zoo.linen_lm), ("nnx_lm", zoo.nnx_lm), ("eqx_lm", zoo.eqx_lm))


def _timed(calls: dict, runs: int) -> dict:
    """Median seconds of each no-argument callable, interleaved rounds after a warm-up."""
    times = {k: [] for k in calls}
    for r in range(runs + 1):
        for k, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_model(name: str, maker, mesh, runs: int) -> list:
    fn, *args = maker(zoo.Config(batch=16))
    args = tuple(args)
    step = autopar.autoparallel(fn, mesh=mesh, strategy="dp", time_limit_s=10)
    step(*args)                                        # plans, compiles, remembers the shortcut
    exe = step.compile(*args).jax
    placed = jax.device_put(args, exe.input_shardings[0])
    leaves = len(jax.tree_util.tree_leaves(args))

    def whole():
        step._fast.clear()          # the path every call took before the shortcut
        return step(*placed)

    t = _timed({"raw": lambda: exe(*placed), "step": lambda: step(*placed),
                "whole path": whole}, runs)
    ms = {k: v * 1e3 for k, v in t.items()}
    return [name, leaves, ms["raw"], ms["step"], ms["whole path"],
            ms["step"] - ms["raw"], ms["whole path"] - ms["raw"], ms["step"] / ms["raw"],
            ms["whole path"] / ms["raw"]]


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--runs", type=int, default=41)
    args = p.parse_args()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    runs = 5 if args.quick else args.runs
    rows = [run_model(n, m, mesh, runs) for n, m in (MODELS[:1] if args.quick else MODELS)]
    header = ("model", "leaves", "raw ms", "step ms", "whole path ms", "step - raw ms",
              "whole path - raw ms", "step / raw", "whole path / raw")
    text = (f"# What calling a step costs on top of its program\n\n{_common.environment()}.\n\n"
            f"`python benchmarks/call_overhead.py --runs {runs}`: the same executable called raw "
            f"(jax's compiled program on arguments already in its layouts), as the autoparallel "
            f"step (the shortcut for arrays of a signature already run), and as the step with the "
            f"shortcut's table emptied before each call (the whole path: parting and checking "
            f"every leaf). dp on {{data: 8}} CPU devices, medians of {runs} interleaved rounds.\n\n"
            + _common.md_table(header, rows) + "\n")
    _common.write_md(args, "call_overhead.md", text)


if __name__ == "__main__":
    main()
