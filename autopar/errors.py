"""Errors autopar raises. Every message says what was given, where, the rule it breaks and a fix.

One hierarchy: ``AutoparError`` (a ``ValueError``, defined in ``ir.errors`` so the lower layers
share it) is the root; ``ir.IRError``, ``cost_models.CostModelError``, ``PlanError`` and
``ShardingError`` derive from it, so ``except autopar.AutoparError`` catches every user error.
``CheckpointError`` is the one error about files rather than arguments: a checkpoint step that is
damaged, incomplete or unreadable.
"""
from __future__ import annotations

from ir.errors import AutoparError

__all__ = ["AutoparError", "BudgetError", "CheckpointError", "PlanError", "ShardingError"]


class PlanError(AutoparError):
    """No plan satisfies the request (e.g. the memory budget is below what any plan needs), or a
    saved plan cannot be loaded or applied."""


class BudgetError(PlanError):
    """No plan found fits the memory budget (the planner tried recomputation where the step has
    a scanned model's loops; ``least_bytes``: the smallest peak found, None if unknown)."""

    def __init__(self, message: str, least_bytes: float | None = None):
        super().__init__(message)
        self.least_bytes = least_bytes


class ShardingError(AutoparError):
    """A mesh, a sharding, an argument or a shape does not fit what was asked."""


class CheckpointError(AutoparError):
    """A saved checkpoint step cannot be restored as it is: a file is damaged, missing or
    unreadable, or its metadata contradicts itself. The message names the checkpoint directory,
    the step, the file and (where known) the arrays it holds; ``restore(..., fallback=True)``
    takes the newest intact step instead."""
