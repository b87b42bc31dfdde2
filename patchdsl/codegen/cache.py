"""The on-disk kernel cache: the one place codegen writes files and imports them.

Path: ``<cache>/<hash[:2]>/<name>_<hash[:16]>.py`` where the hash covers the template text,
the parameters, the patchdsl version and the Triton version.  Files are written to a temporary
name in the same folder and ``os.replace``d, so concurrent writers never leave a torn file.
Triton's ``@jit`` needs the function's source file, so generated modules are imported from
their files, never exec'd from strings.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from .._version import __version__
from .env import ensure_triton
from .keys import KernelKey, content_hash
from .render import render, template_text

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    d = os.environ.get("PATCHDSL_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchdsl" / "kernels"


def _triton_version() -> str:
    return ensure_triton().__version__


def key_hash(key: KernelKey) -> str:
    return content_hash(template_text(key.template), key, __version__, _triton_version())


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".py", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_kernel(key: KernelKey, directory: Path | None = None, *, flat: bool = False) -> Path:
    """Render ``key`` and write it atomically; return the file path.  Idempotent."""
    digest = key_hash(key)
    root = Path(directory) if directory is not None else cache_dir()
    folder = root if flat else root / digest[:2]
    path = folder / (f"{key.name}.py" if flat else f"{key.name}_{digest[:16]}.py")
    if path.is_file() and not flat:
        return path
    atomic_write(path, render(key))
    return path


def load_kernel(key: KernelKey) -> ModuleType:
    """Return the imported generated module for ``key`` (rendering and caching it if needed)."""
    ensure_triton()
    with _lock:
        mod = _loaded.get(key.params_json() + key.template)
        if mod is not None:
            return mod
        path = write_kernel(key)
        modname = f"patchdsl_kernels.{path.stem}"
        spec = importlib.util.spec_from_file_location(modname, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        _loaded[key.params_json() + key.template] = mod
        return mod
