"""A decorated step's lowered and compiled forms (``step.lower(...)``, ``step.compile(...)``),
callable with what the step itself takes.

``jax.jit(f).lower(x).compile()`` runs only on arguments already in the executable's layouts and
in its flattened form. The step's own forms take what ``step(...)`` takes (NNX objects, modules
with static leaves, arrays committed in any layout) and do what it does: part the arguments
(``autopar.arguments``), move each array into its planned layout, run, and write NNX changes back.
Everything else (``as_text``, ``memory_analysis``, ``cost_analysis``, ``input_shardings``, ...) is
read through from jax's object, which ``.jax`` holds.
"""
from __future__ import annotations

from typing import Any


class Lowered:
    """``step.lower(*args)``: jax's ``Lowered`` for the step's signature, and ``compile()``."""

    def __init__(self, step, key: tuple, lowered):
        self._step, self._key, self.jax = step, key, lowered

    def compile(self, *args, **kwargs) -> Compiled:
        """The executable (compiled once per signature; the step's own calls share it)."""
        return self._step._compiled_for(self._key, lambda: self.jax.compile(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jax, name)


class Compiled:
    """The step's executable for one signature; ``compiled(*args)`` runs it as ``step(*args)``
    does, for arguments of that signature."""

    def __init__(self, step, key: tuple, compiled):
        self._step, self._key, self.jax = step, key, compiled

    def __call__(self, *args, **kwargs):
        return self._step._call_compiled(self._key, self.jax, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jax, name)
