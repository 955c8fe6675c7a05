"""What a call of an autopar step costs with Flax NNX objects, against ``nnx.jit`` and against the
same step split by hand.

For an NNX MLP (Linear + BatchNorm + Dropout blocks) trained by the Flax docs' step
(``train_step(model, optimizer, metrics, batch)``, AdamW through ``nnx.Optimizer``), the
median wall time of one call, after a warm-up call, over ``--calls`` calls, each blocked until
its results are ready:

* ``nnx.jit``: the step under ``@nnx.jit`` (one device);
* ``autopar nnx``: the step, unchanged, under ``autopar.autoparallel`` on 8 CPU devices
  (``strategy="dp"``), NNX objects split on the way in and written back after each call;
* ``autopar split``: the same computation written functionally (``nnx.split`` once, a step of
  ``(state, batch) -> (state, loss)``, the graph definition closed over) under the same decorator
  and strategy: the executable is alike, so ``autopar nnx - autopar split`` is what the NNX
  handling (split, write-back) adds per call;
* ``nnx split+update``: ``nnx.split`` of the three objects plus ``nnx.update`` of their state,
  timed alone: the floor of any NNX write-back (``nnx.jit`` pays it too).

Wall clock on this shared 2-core machine (the load is stamped in the results). Writes
``benchmarks/results/nnx_call.md`` and ``nnx_call.csv``.

    python benchmarks/nnx_call.py            # 2 and 16 blocks (a minute)
    python benchmarks/nnx_call.py --quick    # 2 blocks, few calls
"""
from __future__ import annotations

import statistics
import time

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import autopar

HEADER = ("blocks", "variables", "nnx.jit ms", "autopar nnx ms", "autopar split ms",
          "nnx split+update ms", "autopar nnx - split ms", "autopar nnx / nnx.jit")


class MLP(nnx.Module):
    def __init__(self, blocks: int, width: int, classes: int, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([_Block(width, rngs) for _ in range(blocks)])
        self.head = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x):                       # (B, W)
        for block in self.blocks:
            x = block(x)                         # (B, W)
        return self.head(x)                      # (B, C)


class _Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.dropout(nnx.relu(self.bn(self.linear(x))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


def train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["y"])
    optimizer.update(model, grads)
    return loss


def objects(blocks: int):
    model = MLP(blocks, 64, 10, rngs=nnx.Rngs(0))
    return (model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param),
            nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")))


def split_step(blocks: int):
    """The same step on split state: ``(state, batch) -> (state, loss)``."""
    graphdef, _ = nnx.split(objects(blocks))

    def step(state, batch):
        objs = nnx.merge(graphdef, state)
        loss = train_step(*objs, batch)
        return nnx.state(objs), loss

    return step


def medians_ms(calls: dict, n: int) -> dict:
    """Each call warmed up once (traces, plans, compiles), then ``n`` rounds that run each once
    in turn, so a change in the machine's load falls on every variant alike: median ms each."""
    for call in calls.values():
        jax.block_until_ready(call())
    times: dict = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def row(blocks: int, calls: int, mesh) -> list:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    batch = {"x": jax.random.normal(k1, (64, 64)), "y": jax.random.randint(k2, (64,), 0, 10)}
    ref, objs, alone = objects(blocks), objects(blocks), objects(blocks)
    jitted = nnx.jit(train_step)
    step = autopar.autoparallel(train_step, mesh=mesh, strategy="dp", time_limit_s=10)
    split = autopar.autoparallel(split_step(blocks), mesh=mesh, strategy="dp", time_limit_s=10)
    state = [nnx.split(objects(blocks))[1]]

    def split_call():
        state[0], loss = split(state[0], batch)
        return loss

    def split_update():
        _, s = nnx.split(alone)
        nnx.update(alone, s)
        return jnp.zeros(())

    ms = medians_ms({"jit": lambda: jitted(*ref, batch), "nnx": lambda: step(*objs, batch),
                     "split": split_call, "floor": split_update}, calls)
    n_vars = len(jax.tree.leaves(nnx.state(objs)))
    return [blocks, n_vars, ms["jit"], ms["nnx"], ms["split"], ms["floor"],
            ms["nnx"] - ms["split"], ms["nnx"] / ms["jit"]]


def main() -> None:
    args = _common.parser(__doc__).parse_args()
    calls = 5 if args.quick else 50
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8), ("data",))
    rows = [row(b, calls, mesh) for b in ((2,) if args.quick else (2, 16))]
    _common.write_csv(_common.out_dir(args) / "nnx_call.csv", HEADER, rows)
    _common.write_md(args, "nnx_call.md", "\n".join([
        "# A call of an autopar step with Flax NNX objects",
        "",
        f"{_common.environment()}. Median wall ms per call over {calls} rounds (after one "
        f"warm-up call; each round calls every variant once) of the Flax docs' step on an MLP "
        f"of `blocks` Linear + BatchNorm + Dropout blocks (width 64, batch 64), AdamW via "
        f"`nnx.Optimizer`, metrics; `variables`: the state leaves of model, optimizer and "
        f"metrics. autopar runs on 8 CPU devices with strategy `dp`, `nnx.jit` on one. See "
        f"`benchmarks/nnx_call.py` for the columns.",
        "",
        _common.md_table(HEADER, rows),
        ""]))


if __name__ == "__main__":
    main()
