"""The one check of a site against the live module that both planning (on the meta-device model) and
apply (on the loaded one) run: why an op cannot patch a module, memoised per class and facts."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from ..model.info import ModuleInfo
from ..model.modules import unwrap


def check_site(op: Any, module: Any, host: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
    """Why ``op`` cannot patch ``module`` (hosted on ``host``), or None.  The one check that both
    ``plan`` (on the meta-device model) and ``apply`` (on the live one) run."""
    reason = op.check(unwrap(module), info, flags)
    if reason is None and host is not None and host is not module:
        # ops hosted elsewhere (the loss path on the causal LM) also vet the host
        reason = op.check(unwrap(host), info, flags)
    return reason


def _check_key(op: Any, module: Any, host: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str:
    """Memo key for :func:`check_site` at plan time: the checks look at classes and the structure
    the index recorded, so layers of one class with equal facts and flags get one answer."""
    def shape(m):
        m = unwrap(m)
        return (type(m), "forward" in getattr(m, "__dict__", {}),
                tuple((n, type(unwrap(c))) for n, c in m.named_children()))

    return repr((op.name, shape(module), shape(host) if host is not module else None,
                 json.dumps({k: dict(v) for k, v in info.kinds.items()}, sort_keys=True, default=repr),
                 info.dtype, json.dumps(dict(flags), sort_keys=True, default=repr)))


def model_checker(model: Any) -> Callable[[Any, str, str, ModuleInfo, Mapping[str, Any]], str | None]:
    """``check(op, path, host_path, info, flags)`` on ``model``'s modules (meta device is fine)."""
    modules = dict(model.named_modules())
    memo: dict[str, str | None] = {}

    def check(op, path, host_path, info, flags):
        module = modules.get(path, model if path == "" else None)
        host = modules.get(host_path, model if host_path == "" else None)
        if module is None or host is None:
            return f"{path or host_path} is not in the model"
        key = _check_key(op, module, host, info, flags)
        if key not in memo:
            try:
                memo[key] = check_site(op, module, host, info, flags)
            except Exception as e:      # a check that cannot run on this module refuses it
                memo[key] = f"cannot be checked: {type(e).__name__}: {e}"
        return memo[key]

    return check
