"""External ops: third-party kernels as citizens of the one op registry.

An external op is an :class:`ExternalOp`: an :class:`~patchdsl.ops.base.Op` with ``external = True``
and the lifecycle of a kernel it does not generate.  Planning, selection, precedence, the plan's JSON,
the runtime's apply/undo and ``verify`` treat it like a generated op; the differences are all here:

* ``locate(name, value, file)`` makes a flag independent of the spec's folder (a local repository);
* ``unavailable(params)`` (of every op) says, when a plan is made for this machine, why the kernel
  cannot be had (package missing, no GPU, not in the offline cache), so the error names the site;
* ``source(params)`` is what ``plan`` shows: where the kernel comes from and its pin;
  ``resolved_source`` what this machine resolved it to;
* ``lock(params)`` pins what was resolved (a local repository's sha256) in the plan, and
  ``unlocked(flags)`` refuses a plan file without that pin;
* ``load(params)`` returns the kernel (instead of codegen rendering a template).

Families: ``hub(...)`` (:mod:`.hub`, Hugging Face Hub kernel layers through the ``kernels``
library) and ``liger.*`` (:mod:`.liger`, the ops of an installed Liger-Kernel).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from .base import Op


class ExternalOp(Op):
    """The base of every external op: the lifecycle of a third-party kernel (source, lock, load)."""

    external: ClassVar[bool] = True
    placements = ()          # a third-party kernel: what it does with a shard is not known here

    def locate(self, name: str, value: Any, file: str) -> Any:
        """A flag value as given in ``file`` made independent of it (a local repository path resolved
        against the spec's folder).  Default: unchanged."""
        return value

    def source(self, params: Mapping[str, Any]) -> str:
        """Where the kernel comes from, with its pin, for ``plan``."""
        return ""

    def resolved_source(self, params: Mapping[str, Any]) -> str:
        """``source`` with what this machine resolved it to (called after ``unavailable``)."""
        return self.source(params)

    def lock(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Flags that pin what this machine resolved for ``params`` (a local repository's sha256),
        recorded in the plan after ``unavailable`` passed.  Default: none."""
        return {}

    def unlocked(self, flags: Mapping[str, Any]) -> str | None:
        """Why the flags of a site read from a plan file lack a pin a plan made here records (a
        local repository without its sha256), or None.  Pure."""
        return None

    def load(self, params: Mapping[str, Any]) -> Any:
        """The loaded kernel for ``params`` (what ``kernels(dtype)`` returns)."""
        raise NotImplementedError


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
