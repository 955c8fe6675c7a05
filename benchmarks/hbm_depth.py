"""Predicted HBM bytes and peak memory against XLA as an unrolled model gets deeper.

``verify_matrix``'s rows (``row``: ``step.verify()`` after one step) for its tiny GPT, unrolled,
data parallel on ``1x8``, at 2 to 16 layers. A fusion rule that is wrong by a constant shows as a
constant ratio; one that duplicates work across layers (the residual stream re-added in every
later layer's kernels, before ``ir.fusion``'s ``kept_whole`` rule) shows as a ratio that grows
with depth. Then ``auto`` on ``2x4`` at each depth, planned on the folded graph where
``ir.fold`` folds it (from 8 copies: the first three and the last stay), so the predictions for
the removed layers come from their representative and meet XLA's measurement here; the report
says which depths folded.

    python benchmarks/hbm_depth.py                 # 2, 4, 8, 16 layers (~2 minutes)
    python benchmarks/hbm_depth.py --quick         # 2 and 4 layers
"""
from __future__ import annotations

import dataclasses

import _common  # noqa: F401  (sets XLA_FLAGS before jax is imported)
from verify_matrix import HEADER, TINY, row

from autopar.models import gpt


def main(argv=None):
    args = _common.parser(__doc__).parse_args(argv)
    out = _common.out_dir(args)
    rows = []
    depths = (2, 4) if args.quick else (2, 4, 8, 16)
    for mesh, strategy in (("1x8", "dp"), ("2x4", "auto")):
        for layers in depths:
            model = gpt.concrete(dataclasses.replace(TINY, layers=layers), 16)
            rows.append(row(f"GPT unrolled, {layers} layers", model, mesh, strategy))
            print("  " + "  ".join(_common._cell(x) for x in rows[-1]), flush=True)
    hbm = [r[9] for r in rows[:len(depths)]]
    auto = rows[len(depths):]
    folded = [_folded(layers) for layers in depths]
    text = [
        "# Predicted HBM bytes and memory against XLA, by depth",
        "",
        "`step.verify()` of the tiny GPT of `verify_matrix` (unrolled, data parallel, 8 emulated "
        "CPU devices) at each depth; ratios are predicted / measured.",
        "",
        _common.md_table(HEADER, rows),
        "",
        f"HBM pred/XLA from {hbm[0]:.3f} ({rows[0][0]}) to {hbm[-1]:.3f} "
        f"({rows[len(depths) - 1][0]}), dp on 1x8.",
        "",
        f"auto on 2x4 at {', '.join(map(str, depths))} layers: memory pred/XLA "
        + ", ".join(f"{r[7]:.3f}" for r in auto) + "; HBM pred/XLA "
        + ", ".join(f"{r[9]:.3f}" for r in auto) + "; copies folded out by `ir.fold` "
        + ", ".join(map(str, folded)) + " (0: planned on the full graph).",
        "",
        f"Environment: {_common.environment()}.",
    ]
    _common.write_csv(out / "hbm_depth.csv", HEADER, rows)
    (out / "hbm_depth.md").write_text("\n".join(text) + "\n")
    print(f"wrote {out / 'hbm_depth.md'}")


def _folded(layers: int) -> int:
    """How many layer copies ``ir.fold`` removes from the model at ``layers`` layers."""
    import ir
    from ir.fold import fold

    f = fold(ir.trace(*gpt.concrete(dataclasses.replace(TINY, layers=layers), 16)))
    return f.removed if f is not None else 0


if __name__ == "__main__":
    main()
