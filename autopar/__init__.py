"""autopar: automatic parallelism planning for JAX training steps.

    @autopar.autoparallel(mesh=jax.make_mesh((2, 4), ("data", "model")))
    def train_step(state, batch): ...

See README.md for the guided tour.
"""
from autopar.api import autoparallel, plan
from autopar.errors import AutoparError, PlanError, ShardingError
from autopar.plan import Plan

__all__ = ["AutoparError", "Plan", "PlanError", "ShardingError", "autoparallel", "compare", "plan"]


def compare(*args, **kwargs):
    """Predicted (and measured) step time of hand-written strategies against the auto plan."""
    from autopar.compare import compare as _compare

    return _compare(*args, **kwargs)
