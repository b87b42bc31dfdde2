"""Locate the data folders (grammars/, templates/, specs/) that ship with patchdsl.

In a checkout (including ``pip install -e .``) they are the top-level folders of the
repository, next to the package.  In a wheel they are packaged under
``patchdsl/_data/`` (see ``[tool.hatch.build.targets.wheel.force-include]``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]         # the patchdsl package folder


@lru_cache(maxsize=None)
def data_dir(name: str) -> Path:
    """Return the folder ``name`` (``grammars``, ``templates`` or ``specs``)."""
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"patchdsl data folder {name!r} not found next to {_PKG}")


def grammar_path() -> Path:
    return data_dir("grammars") / "kpatch.lark"


def templates_dir() -> Path:
    return data_dir("templates")


def specs_dir() -> Path:
    return data_dir("specs")


def shipped_spec(name: str) -> Path:
    """``shipped_spec("qwen3")`` -> path of ``specs/qwen3.kpatch``."""
    p = specs_dir() / (name if name.endswith(".kpatch") else name + ".kpatch")
    if not p.is_file():
        raise FileNotFoundError(p)
    return p
