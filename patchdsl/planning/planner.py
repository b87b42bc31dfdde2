"""The planner's entry: a spec (text, a path, a Spec or an already checked spec) against a model (a
module, possibly on the meta device, or its index) -> a :class:`~.plan.PatchPlan`, checked once, with
every check apply makes that needs no weights run now and the kernels' availability here."""

from __future__ import annotations

from typing import Any

from ..codegen.env import target as current_target
from ..model.index import ModelIndex, build_index
from ..syntax import load_spec
from ..syntax.ast import Spec
from .availability import check_available
from .check import CheckedSpec, check_loaded, check_spec
from .plan import PatchPlan, plan_index
from .site_check import model_checker


def plan(spec: CheckedSpec | Spec | str, model: Any, *, target: str | None = None,
         dtypes: tuple[str, ...] | None = None) -> PatchPlan:
    """Plan ``spec`` (a checked spec, a Spec, a path or spec text) against ``model`` (a module, possibly
    on meta, or its ModelIndex).  The spec is checked once: a :class:`CheckedSpec` is used as it is."""
    if isinstance(spec, CheckedSpec):
        checked = spec
    elif isinstance(spec, Spec):
        checked = check_spec(spec)
    else:
        text = spec
        checked = check_loaded(lambda: load_spec(text))
    if target is None:
        target = current_target()
    if isinstance(model, ModelIndex):
        return check_available(checked, plan_index(checked, model, target=target, dtypes=dtypes), None)
    # With the module tree at hand (meta device is fine) every check apply makes that needs no
    # weights runs now, so the plan shows what apply will refuse, and why.
    p = plan_index(checked, build_index(model), target=target, dtypes=dtypes, check=model_checker(model))
    return check_available(checked, p, type(model))
