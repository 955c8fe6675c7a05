"""Per-device parameter memory of HF GPT-2's tensor-parallel stages: attention split or whole.

HF's Flax GPT-2 (``autopar.pipeline.hf``) pipelined over ``{stage: 2, data: 2, model: 2}`` (1F1B,
4 microbatches), its state in the stacked layout, two ways:

* **MLP split** (before head-aligned attention): only the MLP's ``c_fc`` / ``c_proj`` split over
  ``model``; every device of a stage holds its layers' whole attention;
* **MLP + attention split** (``MEGATRON_GPT2``): also ``c_attn`` (``(3, H, Dh, D)``, heads) and
  ``attn/c_proj`` (``(D, H, Dh)``, heads) split over ``model``.

Per device: the parameter bytes by group, predicted from shapes and layouts (a leaf's bytes over
the sizes of the mesh axes its spec names) and measured from the placed arrays' shards on device
0; the compiled step's ``memory_analysis()`` arguments (parameters, Adam's two moments, batch)
against ``3 x`` the parameters plus the batch rows; and the collectives inside the tick loop
of the compiled HLO.

Writes ``benchmarks/results/pipeline_stage_tensor.md``.

    python benchmarks/pipeline_stage_tensor.py            # 4 layers, width 256
    python benchmarks/pipeline_stage_tensor.py --quick    # 4 layers, width 64
"""
from __future__ import annotations

import collections
import dataclasses
import math

import _common
import jax
import numpy as np

from autopar import hlo
from autopar.models import hf
from autopar.pipeline import hf as PH
from autopar.pipeline import model as PM
from autopar.pipeline import runtime as R
from autopar.pipeline import schedules as S

MESH = {"stage": 2, "data": 2, "model": 2}
GROUPS = ("attn", "mlp", "ln", "rest")
HEADER = ("layout", *(f"{g}_KiB predicted / measured" for g in GROUPS),
          "arguments_KiB predicted / measured", "loop all-reduces (model)",
          "loop collective-permutes (stage)")


def _group(path) -> str:
    keys = PM.key_names(path)
    if "h" not in keys:
        return "rest"
    return next((g for g in ("attn", "mlp") if g in keys), "ln")


def _predicted(tree, specs) -> collections.Counter:
    out = collections.Counter()
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                               jax.tree_util.tree_leaves(specs, is_leaf=_is_spec)):
        split = math.prod(MESH[a] for a in tuple(spec) if a is not None)
        out[_group(path)] += x.size * x.dtype.itemsize / split
    return out


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _measured(tree) -> collections.Counter:
    dev, out = jax.devices()[0], collections.Counter()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[_group(path)] += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    return out


def _loop_collectives(text: str) -> tuple[int, int]:
    looped = [c for c in hlo.collectives(hlo.parse(text)) if c.count > 1]
    return (sum(c.kind == "all-reduce" for c in looped),
            sum(c.kind == "collective-permute" for c in looped))


def measure(sm, state, batch, name: str) -> tuple:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(*MESH.values()), tuple(MESH))
    run = R.build_step(sm, mesh, S.build("1f1b", 2, 1, 4))
    stacked = run.stack_state(state)
    specs = R.state_specs(sm, stacked["params"], "stage", "model", 2)
    want, got = _predicted(stacked["params"], specs), _measured(stacked["params"])
    compiled = run.jitted(stacked, batch).lower(stacked, batch).compile()
    rows = sum(x.nbytes for x in jax.tree_util.tree_leaves(batch)) / MESH["data"]
    args = (3 * sum(want.values()) + rows) / 1024
    cells = [f"{want[g] / 1024:.1f} / {got[g] / 1024:.1f}" for g in GROUPS]
    measured_args = compiled.memory_analysis().argument_size_in_bytes / 1024
    return (name, *cells, f"{args:.1f} / {measured_args:.1f}",
            *_loop_collectives(compiled.as_text()))


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    width = 64 if args.quick else 256
    config = hf.tiny("gpt2", layers=4, width=width)
    step, init = PH.gpt2_train_step(config)
    state, batch = init(jax.random.PRNGKey(0)), hf.make_batch("gpt2", config, 8, seq=16)
    sm = PM.staged_model_of(step)
    mlp_only = {k: v for k, v in sm.tensor_dims.items() if k.startswith("mlp/")}
    rows = [measure(dataclasses.replace(sm, tensor_dims=mlp_only), state, batch, "MLP split"),
            measure(sm, state, batch, "MLP + attention split")]
    text = (f"# HF GPT-2 tensor-parallel stages: per-device parameters, attention split or "
            f"whole\n\n{_common.environment()}\n\nHF GPT-2, 4 layers, width {width}, 4 heads, "
            f"mesh {_common.mesh_str(MESH)}, 1F1B, 4 microbatches of 2 rows x 16 tokens. "
            f"Parameter bytes per device (device 0) by group, predicted from the layouts and "
            f"measured from the placed arrays' shards; arguments from `memory_analysis()` of "
            f"the compiled step (parameters, Adam's two moments, the device's batch rows); "
            f"collective instructions inside the tick loop of its HLO.\n\n"
            f"{_common.md_table(HEADER, rows)}\n")
    _common.write_md(args, "pipeline_stage_tensor.md", text)


if __name__ == "__main__":
    main()
