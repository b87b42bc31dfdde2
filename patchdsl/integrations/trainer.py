"""Load a spec from TrainingArguments-style configuration and apply it with a Trainer callback.

    from patchdsl.integrations.trainer import PatchdslCallback
    trainer = Trainer(model, args, ..., callbacks=[PatchdslCallback({"spec": "qwen3"})])

The configuration is a spec path or shipped name, or a mapping with exactly these keys:

    spec:   path or shipped name of a .kpatch file            (this, or rules)
    rules:  list of rule lines (spec text, one statement each) (this, or spec)
    dtype:  list of dtypes to specialise for                   (optional, with rules)
    strict: refuse to start training if any site is refused    (optional, default true)

Unknown keys are errors with a did-you-mean, never silently dropped.  The plan is applied at
``on_train_begin`` to the PEFT-unwrapped model (as ``use_liger_kernel`` is), and undone at
``on_train_end``, so a standalone ``evaluate()`` runs the original model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..syntax import SpecError, load_spec, parse_spec
from ..syntax.ast import Spec
from ..syntax.errors import did_you_mean

CONFIG_KEYS = ("spec", "rules", "dtype", "strict")


def spec_from_config(config: Any) -> tuple[Spec, bool]:
    """(spec, strict) from a path / shipped name / Spec / mapping (see the module docstring)."""
    if isinstance(config, Spec):
        return config, True
    if isinstance(config, (str, Path)):
        return load_spec(config), True
    if not isinstance(config, Mapping):
        raise SpecError(f"patchdsl config must be a spec path or a mapping, got {type(config).__name__}")
    for k in config:
        if k not in CONFIG_KEYS:
            raise SpecError(f"unknown patchdsl config key '{k}'",
                            hint=did_you_mean(str(k), CONFIG_KEYS) or f"keys: {', '.join(CONFIG_KEYS)}")
    strict = config.get("strict", True)
    if not isinstance(strict, bool):
        raise SpecError(f"patchdsl config 'strict' must be true or false, got {strict!r}")
    if ("spec" in config) == ("rules" in config):
        raise SpecError("patchdsl config needs exactly one of 'spec' (a file) or 'rules' (a list of lines)")
    if "spec" in config:
        if "dtype" in config:
            raise SpecError("'dtype' goes in the spec file when 'spec' is given")
        return load_spec(config["spec"]), strict
    rules = config["rules"]
    if isinstance(rules, str) or not all(isinstance(r, str) for r in rules):
        raise SpecError("patchdsl config 'rules' must be a list of strings (one statement each)")
    lines = []
    if "dtype" in config:
        dts = config["dtype"]
        dts = [dts] if isinstance(dts, str) else list(dts)
        lines.append("dtype " + ", ".join(dts))
    lines.extend(rules)
    return parse_spec("\n".join(lines) + "\n", "<config>"), strict


def _base_model(model: Any) -> Any:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


try:  # transformers is a dependency, but keep the syntax-only import path light
    from transformers import TrainerCallback as _Base
except Exception:  # pragma: no cover
    _Base = object


class PatchdslCallback(_Base):
    """Apply a patch plan for the duration of ``Trainer.train()``."""

    def __init__(self, config: Any):
        self.spec, self.strict = spec_from_config(config)
        self.handle = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ..planner import plan
        from ..runtime import apply

        if model is None:
            raise RuntimeError("PatchdslCallback needs the model (Trainer passes it to callbacks)")
        base = _base_model(model)
        self.handle = apply(plan(self.spec, base), base, strict=self.strict)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.undo()
            self.handle = None
        return control
