"""Fuzzing what users hand autopar as data: saved plans (JSON) and hardware profiles.

Every outcome is an ``autopar.AutoparError`` or a valid object, never another exception: a plan
that loads renders, saves again and either fits its program or says why not; a profile that
loads plans a small step with finite, non-negative predictions. Examples are derandomised and
bounded so the suite stays fast and repeatable.
"""
from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import autopar
import cost_models
import ir
from autopar import validate
from autopar.api import plan_graph
from cost_models import Hardware

F32 = jnp.float32
FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
           | st.text(max_size=6) | st.sampled_from([0, -1, 1, 2, 0.5, 1e-300, 1e300, "data",
                                                     "model", [], {}]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)


def _step(w, x):
    y = x @ w
    return y, jnp.tanh(y).sum()


ARGS = (jax.ShapeDtypeStruct((16, 8), F32), jax.ShapeDtypeStruct((6, 16), F32))
MESH = {"data": 2, "model": 4}


@functools.cache
def _graph() -> ir.Graph:
    return ir.trace(_step, *ARGS)


@functools.cache
def _saved() -> str:
    return plan_graph(_graph(), MESH, hardware="h100", time_limit_s=1).to_json()


def _paths(node, prefix=()):
    """Every path into a JSON tree, the root included."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
        node, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _near(old, pick: int):
    """A value of the same kind as ``old`` (so that more mutants get past the schema)."""
    if isinstance(old, bool):
        return not old
    if isinstance(old, (int, float)):
        return [old + 1, old - 1, 0, -old, old * 2, math.nan, math.inf, 2**63][pick % 8]
    if isinstance(old, str):
        return ["data", "model", "zz", "", old + "x", "<b>"][pick % 6]
    if isinstance(old, list) and old:
        return [old[::-1], old[1:], old + old[:1], old[:1] * 2][pick % 4]
    return old


def _mutate(doc, path, kind: str, value, pick: int = 0):
    """``doc`` with the node at ``path`` replaced (by ``value`` or a value ``_near`` the old),
    deleted, or given a new sibling/child."""
    if not path:
        return value if kind == "replace" else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if kind == "near":
        parent[key] = _near(parent[key], pick)
    elif kind == "replace":
        parent[key] = value
    elif kind == "delete":
        del parent[key]
    elif isinstance(parent, list):
        parent.insert(key, value)
    else:
        parent[f"{key}_x"] = value
    return doc


MUTATION = st.tuples(st.integers(0, 10**6),
                     st.sampled_from(["near", "near", "replace", "delete", "insert"]), JSON,
                     st.integers(0, 100))


@settings(FUZZ, max_examples=150)
@given(st.lists(MUTATION, min_size=1, max_size=3), st.integers(0, 10**6), st.booleans())
def test_mutated_plan_json_is_an_autopar_error_or_a_valid_plan(mutations, cut, truncate):
    doc = json.loads(_saved())
    for index, kind, value, pick in mutations:
        paths = list(_paths(doc))
        doc = _mutate(doc, paths[index % len(paths)], kind, value, pick)
    text = json.dumps(doc)
    if truncate:
        text = text[: cut % (len(text) + 1)]
    try:
        plan = autopar.Plan.from_json(text)
    except autopar.AutoparError as e:
        event(f"rejected: {type(e).__name__}")
        return
    assert plan.summary() and plan._repr_html_()
    assert autopar.Plan.from_json(plan.to_json()) == plan
    try:
        validate.plan_applies(plan, _graph())
    except autopar.AutoparError:
        event("loads, does not apply")
        return
    event("loads and applies")


def _profile_paths():
    d = cost_models.hardware("h100").to_dict()
    out = []
    for k, v in d.items():
        out.append((k,))
        if isinstance(v, dict):
            out += [(k, kk) for kk in v] + [(k, "extra")]
    return out


NUMBERS = (st.floats() | st.integers(-2**64, 2**64)
           | st.sampled_from([0, -1, 1e-30, 1e-3, 0.5, 1, 1.5, 8, 1e30, math.inf, math.nan]))


@settings(FUZZ, max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(_profile_paths()), NUMBERS | JSON), min_size=1,
                max_size=3))
def test_random_hardware_profile_is_an_autopar_error_or_plans(changes):
    doc = cost_models.hardware("h100").to_dict()
    for path, value in changes:
        doc = _mutate(doc, path, "replace", value)
    try:
        hw = Hardware.from_json(json.dumps(doc))
    except autopar.AutoparError:
        event("profile rejected")
        return
    try:
        plan = plan_graph(_graph(), MESH, hardware=hw, time_limit_s=0.5)
    except autopar.AutoparError as e:
        event(f"plan rejected: {type(e).__name__}")
        return
    event("planned")
    cost = plan.cost
    for figure in (cost.step_time_s, cost.compute_s, cost.comm_s, cost.transition_s,
                   cost.peak_memory_bytes):
        assert math.isfinite(figure) and figure >= 0, cost
