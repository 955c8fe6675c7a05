"""autopar: automatic parallelism planning for JAX training steps.

    @autopar.autoparallel(mesh=jax.make_mesh((2, 4), ("data", "model")))
    def train_step(state, batch): ...

See docs/ (a MkDocs site; start at docs/index.md) for the guided tour.
"""
from autopar import checkpoint, distributed, strategies
from autopar.api import autoparallel, plan
from autopar.compare import compare
from autopar.errors import AutoparError, BudgetError, PlanError, ShardingError
from autopar.pipeline import megatron_3d as _megatron_3d  # noqa: F401  (registers the strategy)
from autopar.pipeline.user import value_and_grad
from autopar.plan import Plan
from autopar.verify import verify

__all__ = ["AutoparError", "BudgetError", "Plan", "PlanError", "ShardingError", "autoparallel",
           "checkpoint", "compare", "distributed", "plan", "strategies", "value_and_grad",
           "verify"]


def __getattr__(name: str):
    # ``autopar.models`` (reference models for examples, tests and benchmarks) loads on first use
    # so that ``import autopar`` does not import flax's model code it may never need.
    if name == "models":
        import importlib

        return importlib.import_module("autopar.models")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
