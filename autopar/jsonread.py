"""Readers of the JSON a saved plan is made of: each checks one value's type and range and
raises ``PlanError`` naming where in the document it is (``where``) and what was found, so a
hand-edited or truncated plan file is refused with a message, never half-loaded."""
from __future__ import annotations

import math
import numbers
from typing import Any

from autopar.errors import PlanError


def fields(x, where: str, names, optional=()) -> dict:
    if not isinstance(x, dict):
        raise PlanError(f"{where} must be a JSON object with fields {names}; got {x!r:.80}")
    unknown, missing = sorted(set(x) - set(names)), [n for n in names
                                                     if n not in x and n not in optional]
    if unknown or missing:
        raise PlanError(f"{where}: unknown fields {unknown} / missing fields {missing}")
    return x


def seq(x, where: str, length: int | None = None) -> list:
    if not isinstance(x, list):
        raise PlanError(f"{where} must be a JSON list; got {x!r:.80}")
    if length is not None and len(x) != length:
        raise PlanError(f"{where} has {len(x)} entries where {length} were expected")
    return x


def pairs(x, where: str) -> list[tuple[Any, Any]]:
    return [tuple(seq(p, f"{where}[{k}]", 2)) for k, p in enumerate(seq(x, where))]


def text(x, where: str) -> str:
    if not isinstance(x, str):
        raise PlanError(f"{where} must be a string; got {x!r:.80}")
    return x


def choice(x, where: str, options, what: str) -> str:
    """A string among ``options``; ``what`` names it in the error ("a kernel")."""
    x = text(x, where)
    if x not in options:
        raise PlanError(f"{where} is {x!r}; {what} is one of {tuple(options)}")
    return x


def texts(x, where: str) -> tuple[str, ...]:
    return tuple(text(v, f"{where}[{k}]") for k, v in enumerate(seq(x, where)))


def integer(x, where: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise PlanError(f"{where} must be an integer >= {lo}; got {x!r:.80}")
    return x


def number(x, where: str) -> float:
    """A finite number >= 0, kept as JSON gave it (an int stays an int: to_json is unchanged)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
        raise PlanError(f"{where} must be a finite number >= 0; got {x!r:.80}")
    return x


def shape(x, where: str) -> tuple[int, ...]:
    return tuple(integer(n, f"{where}[{i}]") for i, n in enumerate(seq(x, where)))
