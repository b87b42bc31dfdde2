"""Translate a transformers ``KernelConfig`` kernel mapping into the equivalent patchdsl spec.

    {"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm",
     "MLP": {"cuda": "kernels-community/activation:SiluAndMul", "rocm": "..."},
     "LayerNorm": ["kernels-community/layer_norm:LayerNorm", {"version": 2}],
     "RMSNorm2": "/abs/path/to/repo:MyRMSNorm"}

becomes one rule per mapped layer name::

    *: Qwen3RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", version=1)

``kernels.kernelize`` replaces the forward of every module whose class carries
``kernel_layer_name`` equal to a key of the mapping (set by ``@use_kernel_forward_from_hub(name)``
on transformers' modeling classes), on the model's device.  The rule says the same thing: every
module (``*``) of those classes.  Value forms, as ``KernelConfig`` takes them: a ``"repo:Layer"``
string (pinned ``version=1``, transformers' default), a ``[string, {"version"|"revision"|
"trust_remote_code": ...}]`` pair (JSON's form of its tuple), a dict by device, and an absolute
local path ``"/path/to/repo:Layer"``.  Function kernels (``use_kernelized_func``, e.g.
``rotary_pos_emb``) replace functions, not modules; they are listed as comments.

The layer names come from the class (``kernel_layer_name``, when transformers' ``kernels``
integration is active) or, when it is not (a ``kernels`` version transformers does not accept),
from the ``@use_kernel_forward_from_hub("...")`` decorator in the class's source.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from functools import lru_cache
from typing import Any, Mapping

DEVICES = ("cuda", "rocm", "xpu", "npu", "neuron", "tpu", "mps", "cpu")


class MappingError(ValueError):
    """A mapping value that is not one of KernelConfig's forms (the message says which)."""


@lru_cache(maxsize=None)
def _decorated(module_name: str) -> tuple[dict[str, str], dict[str, str]]:
    """({class name: layer name}, {function name: layer name}) for the
    ``@use_kernel_forward_from_hub("Name")`` classes and functions of a module's source."""
    mod = sys.modules.get(module_name)
    try:
        tree = ast.parse(inspect.getsource(mod))
    except (OSError, TypeError, SyntaxError):
        return {}, {}
    classes, funcs = {}, {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        for d in node.decorator_list:
            if (isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", None)) == "use_kernel_forward_from_hub"
                    and d.args and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)):
                (classes if isinstance(node, ast.ClassDef) else funcs)[node.name] = d.args[0].value
    return classes, funcs


def _decorated_in(module_name: str) -> dict[str, str]:
    return _decorated(module_name)[0]


def class_layer_name(cls: type) -> str | None:
    """The kernel layer name ``kernelize`` would look up for instances of ``cls``."""
    name = getattr(cls, "kernel_layer_name", None)
    if isinstance(name, str):
        return name
    for c in cls.__mro__:
        found = _decorated_in(c.__module__).get(c.__name__)
        if found:
            return found
    return None


def layer_names(model: Any) -> dict[str, tuple[str, str]]:
    """{module path: (class name, kernel layer name)} for every module kernelize could replace."""
    out = {}
    for path, m in model.named_modules():
        name = class_layer_name(type(m))
        if name:
            out[path] = (type(m).__name__, name)
    return out


def function_kernels(model: Any) -> dict[str, str]:
    """{module path: kernelized function name} (``use_kernelized_func``), which patchdsl does not translate."""
    out = {}
    for path, m in model.named_modules():
        for fname in (getattr(m, "_kernel_funcs", None) or {}):
            out[path] = fname
        for c in type(m).__mro__:
            for lname in _decorated(c.__module__)[1].values():
                out.setdefault(f"{type(m).__module__}:{lname}", lname)
    return out


VERSION_MAX = 2 ** 31 - 1                          # as the hub op's version flag
REVISION = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")     # as the hub op's revision flag


def _entry(layer: str, value: Any, device: str) -> tuple[str, dict[str, Any]] | None:
    """(``repo:Layer``, metadata) for ``device``, or None when the mapping has no entry for it."""
    if isinstance(value, dict):
        bad = [d for d in value if d not in DEVICES]
        if bad:
            raise MappingError(f"{layer}: unknown device {bad[0]!r} (expected one of {', '.join(DEVICES)})")
        if device not in value:
            return None
        value = value[device]
    meta: dict[str, Any] = {}
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not isinstance(value[1], dict):
            raise MappingError(f"{layer}: a pair must be [\"repo:Layer\", {{\"version\": N}}], got {value!r:.80}")
        value, meta = value
        unknown = set(meta) - {"version", "revision", "trust_remote_code"}
        if unknown:
            raise MappingError(f"{layer}: unknown key(s) {sorted(unknown)} (version, revision, trust_remote_code)")
        if ("version" in meta) == ("revision" in meta):
            raise MappingError(f"{layer}: give exactly one of version and revision")
        v = meta.get("version")
        if "version" in meta and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= VERSION_MAX):
            raise MappingError(f"{layer}: version must be a whole number in [1, {VERSION_MAX}], got {v!r:.60}")
        r = meta.get("revision")
        if "revision" in meta and not (isinstance(r, str) and REVISION.fullmatch(r)):
            raise MappingError(f"{layer}: revision must be a branch, tag or commit (a string without spaces or "
                               f"control characters), got {r!r:.60}")
        t = meta.get("trust_remote_code", False)
        if not isinstance(t, bool):
            raise MappingError(f"{layer}: trust_remote_code must be true or false (JSON booleans), got {t!r:.60}")
    else:
        meta = {"version": 1}          # KernelConfig's default for a plain string
    if not isinstance(value, str) or ":" not in value or "/" not in value:
        raise MappingError(f"{layer}: expected 'org/repo:Layer' or '/abs/path:Layer', got {value!r:.80}")
    return value, meta


def _q(s: str) -> str:
    if '"' in s or "\n" in s:
        raise MappingError(f"{s!r} cannot be written in a spec string")
    return f'"{s}"'


def hub_call(repo_layer: str, meta: Mapping[str, Any]) -> str:
    repo, _, layer = repo_layer.rpartition(":")
    args = [_q(repo), _q(layer)]
    from ..ops.hub import is_local

    if not is_local(repo):
        if "version" in meta:
            args.append(f"version={int(meta['version'])}")
        else:
            args.append(f"revision={_q(str(meta['revision']))}")
        if meta.get("trust_remote_code") is True:
            args.append("trust_remote_code=true")
    return f"hub({', '.join(args)})"


def translate(mapping: Mapping[str, Any], model: Any, *, device: str = "cuda", source: str = "") -> str:
    """The spec text equivalent to ``KernelConfig(kernel_mapping=mapping)`` + ``kernelize`` on ``model``."""
    if not isinstance(mapping, Mapping):
        raise MappingError("a kernel mapping is a JSON object: {\"RMSNorm\": \"org/repo:Layer\", ...}")
    if device not in DEVICES:
        raise MappingError(f"unknown device {device!r} (expected one of {', '.join(DEVICES)})")
    names = layer_names(model)
    classes_by_layer: dict[str, list[str]] = {}
    for cls, lname in names.values():
        classes_by_layer.setdefault(lname, [])
        if cls not in classes_by_layer[lname]:
            classes_by_layer[lname].append(cls)
    funcs = function_kernels(model)
    lines = [f"# translated by patchdsl from the KernelConfig mapping{(' ' + source) if source else ''}",
             f"# for {type(model).__name__} on {device}: the modules kernels.kernelize would replace"]
    rules = []
    for layer, value in mapping.items():
        if layer in set(funcs.values()):
            lines.append(f"# {layer}: a function kernel (use_kernelized_func); patchdsl replaces modules, "
                         f"not functions: not translated")
            continue
        if layer not in classes_by_layer:
            known = sorted(classes_by_layer) + sorted(set(funcs.values()))
            raise MappingError(f"layer {layer!r} is not registered in {type(model).__name__} "
                               f"(its kernel layer names: {', '.join(known) or 'none'})")
        e = _entry(layer, value, device)
        if e is None:
            lines.append(f"# {layer}: no entry for {device}; kernelize keeps the original forward")
            continue
        rules.append(f"*: {'|'.join(classes_by_layer[layer])} -> {hub_call(*e)}     # {layer}")
    if not rules:
        lines.append("# nothing to patch")
    return "\n".join(lines + rules) + "\n"


def load_mapping(path: str) -> Any:
    """The mapping of a JSON file (a saved KernelConfig's ``kernel_mapping`` is taken from it);
    read through :mod:`patchdsl.util.files` (``FileReadError``, a ValueError, when it cannot be)."""
    from ..util.files import read_json

    data = read_json(path, "mapping", what="kernel mapping")
    if isinstance(data, dict) and "kernel_mapping" in data and isinstance(data["kernel_mapping"], dict):
        data = data["kernel_mapping"]          # a saved KernelConfig
    return data
