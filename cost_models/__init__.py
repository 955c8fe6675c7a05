"""autopar's hardware cost model: device profiles, roofline compute, alpha-beta collectives.

``hardware(name)`` loads a profile, ``CostModel(hw, mesh_shape)`` answers the planner's questions
and ``profile()`` measures the local devices. See ``cost_models/README_SECTION.md``.
"""
from __future__ import annotations

from cost_models.hardware import CostModelError, Hardware, Link, hardware
from cost_models.model import CostModel
from cost_models.profile import profile

__all__ = ["CostModel", "CostModelError", "Hardware", "Link", "hardware", "profile"]
