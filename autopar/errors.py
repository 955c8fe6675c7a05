"""Errors autopar raises. Every message says what was given, where, the rule it breaks and a fix."""
from __future__ import annotations


class AutoparError(ValueError):
    """Base class of all autopar errors."""


class PlanError(AutoparError):
    """No plan satisfies the request (e.g. the memory budget is below what any plan needs)."""


class ShardingError(AutoparError):
    """A mesh, a sharding or a shape does not fit what was asked."""
