"""Render a template for a KernelKey.  Pure: same key, same text.

Data never becomes code.  Every value a template sees comes from the key's parameters, and
:func:`validate_params` checks each one at this boundary: a bool, an int that fits 64 bits, a
finite float, ``None``, or a string from a closed set (dtype names, targets, an op flag's
choices) or an identifier matching ``[A-Za-z_][A-Za-z0-9_]*``.  Anything else raises
:class:`CodegenError` before a line is rendered.  Templates emit parameter values through the one
filter ``lit`` (:func:`literal`), and the environment's ``finalize`` sends every non-string
``{{ ... }}`` result through the same function, so a number can only ever appear as a finite
Python literal.  The kernel name (used in the header and in file names) must match
``[A-Za-z0-9_]+`` and the template name ``[A-Za-z0-9_]+.py.j2``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from functools import lru_cache
from typing import Any, Mapping

import jinja2

from .._version import __version__
from ..util.resources import templates_dir
from ..util.vocab import DTYPES, TARGETS
from .keys import KernelKey

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KERNEL_NAME = re.compile(r"[A-Za-z0-9_]{1,200}")
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_]+\.py\.j2")
INT_LIMIT = 2 ** 63

# String parameters whose values come from a closed set (whatever op they belong to).
CLOSED_SETS: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES, "w_dtype": DTYPES, "target": TARGETS, "casting": ("llama", "gemma"),
    "dw_reduce": ("kernel", "atomic"), "dw_zero": ("fill", "forward"), "glu_layout": ("rows", "flat"),
    "fwd_layout": ("per_token", "block"), "bwd_layout": ("per_token", "block"),
    "rotary_layout": ("rotate_half", "interleaved", "interleaved_half_cos"),
}


class CodegenError(ValueError):
    """A value that must not reach generated code (non-finite number, free text, bad name)."""


def literal(value: Any, what: str = "value") -> str:
    """The Python source text of ``value``: the only way a parameter value is written into code.

    bool -> True/False; int -> decimal (|x| < 2**63); float -> ``repr`` when finite; None -> None;
    str -> itself when it is an identifier.  Anything else raises :class:`CodegenError`.
    """
    if isinstance(value, jinja2.Undefined):
        str(value)           # StrictUndefined: raises UndefinedError naming the missing parameter
        raise CodegenError(f"{what}: undefined")
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        if not -INT_LIMIT < value < INT_LIMIT:
            raise CodegenError(f"{what}: integer {value} does not fit 64 bits")
        return str(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CodegenError(f"{what}: {value!r} is not a finite number")
        text = repr(float(value))
        float(text)          # a finite float's repr is always a literal; belt and braces
        return text
    if value is None:
        return "None"
    if isinstance(value, str):
        if IDENT.fullmatch(value):
            return value
        raise CodegenError(f"{what}: {value!r} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)")
    raise CodegenError(f"{what}: a {type(value).__name__} cannot be written into generated code")


def _closed_set(op_name: str, param: str) -> tuple[str, ...] | None:
    if param in CLOSED_SETS:
        return CLOSED_SETS[param]
    from ..ops.registry import get_op

    op = get_op(op_name)
    spec = op.flag(param) if op is not None else None
    if spec is not None and spec.type == "choice":
        return tuple(c for c in spec.choices if isinstance(c, str))
    return None


def validate_params(op_name: str, params: Mapping[str, Any]) -> None:
    """Check every parameter of a kernel key (see the module docstring); raise CodegenError."""
    for name, value in params.items():
        if not isinstance(name, str) or not IDENT.fullmatch(name):
            raise CodegenError(f"kernel parameter name {name!r} is not an identifier")
        what = f"kernel parameter {name}"
        if isinstance(value, str):
            allowed = _closed_set(op_name, name)
            if allowed is not None and value not in allowed:
                raise CodegenError(f"{what}: {value!r} is not one of {', '.join(allowed)}")
        literal(value, what)


def validate_key(key: KernelKey) -> None:
    """Validate a whole key: op, template and kernel names, then every parameter."""
    from ..ops.registry import get_op

    if not isinstance(key.op, str) or get_op(key.op) is None:
        raise CodegenError(f"unknown op {key.op!r}")
    if not isinstance(key.template, str) or not TEMPLATE_NAME.fullmatch(key.template) \
            or key.template != get_op(key.op).template:
        raise CodegenError(f"template {key.template!r} is not the template of {key.op}")
    if not isinstance(key.name, str) or not KERNEL_NAME.fullmatch(key.name):
        raise CodegenError(f"kernel name {key.name!r} must match [A-Za-z0-9_]+ (at most 200 characters)")
    validate_params(key.op, key.param_dict)


def _finalize(value: Any) -> Any:
    # Strings are template text, macro output or parameters validated above; everything else
    # (numbers computed in a template, a parameter emitted without ``| lit``) goes through literal.
    if isinstance(value, (str, jinja2.Undefined)):   # Undefined: StrictUndefined raises on str()
        return value
    return literal(value, "template expression")


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_finalize,
    )
    env.filters["lit"] = literal
    return env


def template_text(name: str) -> str:
    """The template's source plus every template it includes (for the content hash)."""
    root = templates_dir()
    text = (root / name).read_text()
    shared = sorted(p for p in root.glob("_*.j2"))
    return text + "".join(p.read_text() for p in shared)


def header(key: KernelKey) -> str:
    """The provenance header: every value in it is validated (no newline can end a comment)."""
    validate_key(key)
    params = json.dumps(key.param_dict, sort_keys=True, indent=None, ensure_ascii=True, allow_nan=False)
    return (
        f"# Generated by patchdsl {__version__} from templates/{key.template} -- do not edit.\n"
        f"# Kernel: {key.name}\n"
        f"# Specialised for: {params}\n"
        f"# Regenerate with: patchdsl codegen SPEC --model MODEL --out DIR\n"
    )


def op_prefix(key: KernelKey) -> str:
    """Prefix of the names of the module's ``torch.library`` custom ops (``patchdsl::<prefix>_fwd``...).

    The kernel name made an identifier, plus a hash of the template text and the parameters:
    kernels that differ in anything (eps, a flag the name does not show) never share an op name,
    and the same key always gives the same name (re-importing a module finds its ops registered).
    """
    h = hashlib.sha256()
    for part in (template_text(key.template), key.template, key.params_json()):
        h.update(part.encode())
        h.update(b"\0")
    return f"{re.sub(r'[^0-9A-Za-z_]', '_', key.name)}_{h.hexdigest()[:10]}"


def render(key: KernelKey) -> str:
    """Render the op's template for ``key`` and prefix the provenance header."""
    head = header(key)               # validates the key first
    tmpl = _env().get_template(key.template)
    body = tmpl.render(**key.param_dict, kernel_name=key.name, op_prefix=op_prefix(key))
    return head + body
