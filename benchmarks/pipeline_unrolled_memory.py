"""Per-device memory of pipelining an unrolled model: the stacked layout against the user's own.

HF's Flax GPT-2 (``autopar.pipeline.hf``) pipelined over ``{stage: 4, data: 2}`` (1F1B, 4
microbatches), compiled two ways and measured with ``memory_analysis()`` (per device: arguments,
outputs, temporaries):

* **stacked** (what ``autopar.pipeline`` runs): the state in the stacked layout, each stage
  holding its own layers' parameters and Adam moments (``run.stack_state``);
* **user layout**: the same step taking and returning HF's own unrolled state, stacking on entry
  and unstacking on exit inside the program. Each per-layer leaf is one whole array, which one
  ``jax.jit`` program can only place on every stage (replicated over the stage axis).

Writes ``benchmarks/results/pipeline_unrolled_memory.md``.

    python benchmarks/pipeline_unrolled_memory.py            # 8 layers, width 256
    python benchmarks/pipeline_unrolled_memory.py --quick    # 4 layers, width 64

The predicted arguments are parameters and Adam's two moments: ``3 x (L / P layers + the rest)``
stacked, ``3 x (L layers + the rest)`` in the user's layout.
"""
from __future__ import annotations

import _common
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.models import hf
from autopar.pipeline import hf as PH
from autopar.pipeline import model as PM
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

MESH = {"stage": 4, "data": 2}
HEADER = ("layout", "predicted_arguments_MiB", "arguments_MiB", "outputs_MiB",
          "temporaries_MiB", "total_MiB")


def _predicted_mib(sm, stacked, stages: int) -> tuple[float, float]:
    """Arguments per device, parameters and Adam's two moments (3 x): the stacked layout holds
    ``L / P`` layers and the rest, the user's layout all ``L`` layers and the rest."""
    layers, rest = (_bytes(t) for t in sm.split(stacked["params"]))
    return 3 * (layers / stages + rest) / 2**20, 3 * (layers + rest) / 2**20


def _bytes(tree) -> float:
    return float(sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree)))


def _mib(ma) -> tuple[float, float, float, float]:
    a, o, t = (x / 2**20 for x in (ma.argument_size_in_bytes, ma.output_size_in_bytes,
                                   ma.temp_size_in_bytes))
    return a, o, t, a + o + t


def measure(layers: int, width: int, rows: int = 8) -> list[tuple]:
    config = hf.tiny("gpt2", layers=layers, width=width)
    step, init = PH.gpt2_train_step(config)
    state = jax.eval_shape(init, jax.random.PRNGKey(0))
    batch = jax.eval_shape(lambda: hf.make_batch("gpt2", config, rows, seq=16))
    sm = PM.staged_model_of(step)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), tuple(MESH))
    run = R.build_step(sm, mesh, S.build("1f1b", 4, 1, 4))
    stacked = jax.eval_shape(sm.stacking.stack_state, state)
    own, everything = _predicted_mib(sm, stacked, MESH["stage"])
    rows_out = [("stacked", own) + _mib(run.jitted(stacked, batch).lower(stacked, batch)
                                        .compile().memory_analysis())]
    st, bt = run.in_shardings_of(stacked, batch)
    rep = NamedSharding(mesh, P())

    def user(s, b):
        new, loss = run.fn(jax.lax.with_sharding_constraint(sm.stacking.stack_state(s), st), b)
        return sm.stacking.unstack_state(new), loss

    users = jax.tree_util.tree_map(lambda _: rep, state)
    compiled = jax.jit(user, in_shardings=(users, bt), out_shardings=(users, rep)).lower(
        state, batch).compile()
    rows_out.append(("user layout", everything) + _mib(compiled.memory_analysis()))
    return rows_out


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    layers, width = (4, 64) if args.quick else (8, 256)
    rows = measure(layers, width)
    ratio = rows[1][-1] / rows[0][-1]
    text = (f"# Pipelining an unrolled model: per-device memory by state layout\n\n"
            f"{_common.environment()}\n\nHF GPT-2, {layers} layers, width {width}, mesh "
            f"{_common.mesh_str(MESH)}, 1F1B, 4 microbatches of 2 rows x 16 tokens; "
            f"`memory_analysis()` of the compiled step, per device.\n\n"
            f"{_common.md_table(HEADER, rows)}\n\nThe user's layout needs {ratio:.2f}x the "
            f"stacked layout's memory per device: every stage holds every layer's parameters "
            f"and Adam moments, in and out.\n")
    _common.write_md(args, "pipeline_unrolled_memory.md", text)


if __name__ == "__main__":
    main()
