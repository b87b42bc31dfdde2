"""External ops: third-party kernels as citizens of the one op registry.

An external op is an :class:`~patchdsl.ops.base.Op` with ``external = True``.  Planning,
selection, precedence, the plan's JSON, the runtime's apply/undo and ``verify`` treat it like a
generated op; the differences are all in the op:

* ``load(params)`` returns the kernel (instead of codegen rendering a template);
* ``unavailable(params)`` says, when a plan is made for this machine, why the kernel cannot be
  had (package missing, no GPU, not in the offline cache), so the error names the site;
* ``source(params)`` is what ``plan`` shows: where the kernel comes from and its pin.

Families: ``hub(...)`` (:mod:`.hub`, Hugging Face Hub kernel layers through the ``kernels``
library) and ``liger.*`` (:mod:`.liger`, the ops of an installed Liger-Kernel).
"""

from __future__ import annotations

from typing import Any


def kernels_library() -> Any:
    """The ``kernels`` package (ImportError with what to install when missing)."""
    try:
        import kernels
    except ImportError as e:
        raise ImportError(missing_kernels_message()) from e
    return kernels


def missing_kernels_message() -> str:
    return "the `kernels` package is not installed: pip install 'patchdsl[hub]' (or: pip install kernels)"


def package_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
