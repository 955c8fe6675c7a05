"""`make demo`: trace, plan and run a GPT training step on the 8 emulated CPU devices.

Prints the graph summary, the plan summary, the unsharded-vs-sharded numbers and, when the
hand-written strategies are available, the comparison table of auto against them.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autopar  # noqa: E402
import ir  # noqa: E402
from autopar.models import gpt  # noqa: E402


def main() -> None:
    cfg = gpt.GPTConfig(vocab=256, seq=32, d_model=128, heads=4, d_ff=512, layers=2)
    step, state, batch = gpt.concrete(cfg, batch_size=16)
    print("== graph ==")
    print(ir.trace(step, state, batch).summary())

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharded = autopar.autoparallel(step, mesh=mesh, hardware="h100", time_limit_s=5)
    new_state, loss = sharded(state, batch)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    print("\n== plan (H100 cost model, 2x4 mesh of emulated devices) ==")
    print(sharded.plan.summary(max_rows=12))
    err = max(float(np.max(np.abs(a - b))) for a, b in
              zip(jax.tree.leaves(new_state["params"]), jax.tree.leaves(ref_state["params"])))
    print(f"\nloss sharded {float(loss):.6f} vs unsharded {float(ref_loss):.6f}; max parameter "
          f"difference {err:.1e} after one adamw step (lr 1e-3: Adam's first step scales "
          f"rounding-level differences of near-zero gradients up to lr-sized updates)")
    model = gpt.GPT(cfg)

    def grads(params, batch):
        return jax.grad(gpt.loss_fn)(params, model, batch)

    g_sharded = autopar.autoparallel(grads, mesh=mesh, hardware="h100", time_limit_s=5)(
        state["params"], batch)
    g_ref = jax.jit(grads)(state["params"], batch)
    gerr = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
               for a, b in zip(jax.tree.leaves(g_sharded), jax.tree.leaves(g_ref)))
    print(f"gradients of the sharded plan vs unsharded: max relative difference {gerr:.1e}")

    print("\n== a 256-GPU plan made on this laptop: GPT-1.3B on {data: 32, model: 8}, A100 ==")
    import dataclasses

    big = dataclasses.replace(gpt.GPT_CONFIGS["1.3B"], scan=True)
    bstep, bstate, bbatch = gpt.abstract(big, 256)
    plan = autopar.plan(bstep, bstate, bbatch, mesh={"data": 32, "model": 8}, hardware="a100",
                        time_limit_s=10)
    print(plan.cost)
    print(f"planned in {plan.solver.trace_s + plan.solver.build_s + plan.solver.solve_s:.1f} s "
          f"({plan.solver.status}, gap "
          f"{'unknown' if plan.solver.gap is None else f'{plan.solver.gap:.1%}'})")

    print("\n== auto against hand-written strategies (2x4 mesh, measured on CPU) ==")
    print(autopar.compare(step, state, batch, mesh=mesh, hardware="cpu",
                          strategies=("dp", "zero3", "megatron", "fsdp_tp", "auto"),
                          measure=True, time_limit_s=5))


if __name__ == "__main__":
    main()
