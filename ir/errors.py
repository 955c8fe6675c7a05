"""Errors raised by ``ir``: all are ``ValueError``s so callers can catch them broadly."""
from __future__ import annotations


class IRError(ValueError):
    """A graph breaks an IR invariant (see ``ir.verify``)."""


class UnsupportedPrimitiveError(IRError):
    """A primitive the tracer cannot represent (e.g. one carrying a sub-jaxpr of unknown shape)."""
