"""The root of every error autopar raises for bad input, and the errors raised by ``ir``.

``AutoparError`` lives here, at the lowest layer, so that ``ir`` and ``cost_models`` (which never
import ``autopar``) raise errors that ``except autopar.AutoparError`` catches; ``autopar``
re-exports it. It is a ``ValueError``: every one of them is a bad value handed in by the user.
Internal invariant failures are ``AssertionError``s, never one of these.
"""
from __future__ import annotations


class AutoparError(ValueError):
    """Bad input to autopar. The message says what was given, where, and how to fix it."""


AutoparError.__module__ = "autopar"   # tracebacks name it as users import it: autopar.AutoparError


class IRError(AutoparError):
    """A graph breaks an IR invariant (see ``ir.verify``)."""


class UnsupportedPrimitiveError(IRError):
    """A primitive the tracer cannot represent (e.g. one carrying a sub-jaxpr of unknown shape)."""
