"""The on-disk kernel cache: the one place codegen writes files and imports them.

Path: ``<cache>/<hash[:2]>/<name>_<hash[:16]>.py`` where the hash covers the template text,
the parameters, the patchdsl version and the Triton version.  Files are written to a temporary
name in the same folder and ``os.replace``d, so concurrent writers never leave a torn file.
Triton's ``@jit`` needs the function's source file, so generated modules are imported from
their files, never exec'd from strings.

Safety (docs/reliability.md):

* The cache folder is created private (mode 0700).  A folder owned by another user, or
  writable by group or others, is refused with :class:`CacheError` (code imported from it could
  have been planted); nothing is imported from it.
* Every cached file starts with ``# patchdsl-sha256: <hex>``, the sha256 of the rest of the file.
  Before import the line is checked against the file's own text and against the text this
  version renders for the key.  A file that fails (truncated, half written, edited, planted) is
  regenerated with a warning.
* A cache folder that cannot be written (read-only, full disk, no permission) falls back, with a
  warning, to a private temporary folder (``tempfile.mkdtemp``) for the rest of the process.
  No raw ``OSError`` reaches the caller: what cannot be recovered is a :class:`CacheError`.
* Kernel names are validated (``[A-Za-z0-9_]+``) and every path is checked to stay inside the
  cache folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

from .._version import __version__
from .env import ensure_triton
from .keys import KernelKey, content_hash
from .render import CodegenError, render, template_text, validate_key

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
_fallback: Path | None = None
_checked: set[Path] = set()

SHA_PREFIX = "# patchdsl-sha256: "


class CacheError(RuntimeError):
    """The kernel cache cannot be used (unsafe folder, nothing writable); the message says why."""


class CacheWarning(UserWarning):
    """The cache fell back to a temporary folder, or a cached file was regenerated."""


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


def file_text(key: KernelKey) -> str:
    """What a cache (or ``codegen --out``) file holds: the sha256 line, then the rendered source."""
    body = render(key)
    return f"{SHA_PREFIX}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"


def check_text(text: str, expected: str | None = None) -> str | None:
    """None when ``text`` carries a sha256 line matching its own body (and equals ``expected``
    when given), else what is wrong with it."""
    head, sep, body = text.partition("\n")
    if not head.startswith(SHA_PREFIX) or not sep:
        return "it has no patchdsl-sha256 line"
    if hashlib.sha256(body.encode()).hexdigest() != head[len(SHA_PREFIX):].strip():
        return "its content does not match its sha256 line (truncated, half written or edited)"
    if expected is not None and text != expected:
        return "its content is not what this version renders for the key"
    return None


# ------------------------------------------------------------------ folders
def check_private(folder: Path) -> None:
    """Raise CacheError unless ``folder`` is a directory owned by this user and not writable by
    group or others."""
    try:
        st = os.stat(folder)
    except OSError as e:
        raise CacheError(f"cannot inspect the kernel cache folder {folder}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"the kernel cache path {folder} is not a folder")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheError(
            f"the kernel cache folder {folder} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}): "
            f"patchdsl will not import code from it; set PATCHDSL_CACHE to a folder of your own")
    if st.st_mode & 0o022:
        raise CacheError(
            f"the kernel cache folder {folder} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"anyone could plant code there; run 'chmod 700 {folder}' or set PATCHDSL_CACHE to a private folder")


def _make_private(folder: Path) -> None:
    """Create ``folder`` (0700) if needed and check it.  OSError for an unwritable place."""
    if folder in _checked:
        return
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(13, "the folder is not writable", str(folder))
    _checked.add(folder)


def _fallback_root(reason: str) -> Path:
    global _fallback
    if _fallback is None:
        try:
            _fallback = Path(tempfile.mkdtemp(prefix="patchdsl-kernels-"))
        except OSError as e:
            raise CacheError(f"the kernel cache cannot be written ({reason}) and no temporary folder could be "
                             f"made either: {e.strerror or e}") from None
        warnings.warn(f"patchdsl: the kernel cache cannot be written ({reason}); using the private temporary "
                      f"folder {_fallback} for this process (set PATCHDSL_CACHE to a writable folder)",
                      CacheWarning, stacklevel=3)
    return _fallback


def _inside(root: Path, path: Path) -> Path:
    r, p = root.resolve(), path.resolve()
    if p.parent != r and r not in p.parents:
        raise CodegenError(f"kernel file {path} would leave the folder {root}")
    return path


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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


def _reason(e: OSError) -> str:
    return f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e.strerror or e)


def _cache_path(root: Path, key: KernelKey, digest: str) -> Path:
    return _inside(root, root / digest[:2] / f"{key.name}_{digest[:16]}.py")


def _ensure_file(key: KernelKey) -> Path:
    """The verified cache file for ``key``: written if missing, regenerated if it fails its check,
    in the user's cache or (if that cannot be written) the private fallback folder."""
    validate_key(key)
    digest = key_hash(key)
    expected = file_text(key)
    roots = [cache_dir()] if _fallback is None else [_fallback]
    while True:
        root = roots[-1]
        try:
            _make_private(root)
            path = _cache_path(root, key, digest)
            _make_private(path.parent)
            if path.is_file():
                try:
                    problem = check_text(path.read_text(encoding="utf-8", errors="replace"), expected)
                except OSError as e:
                    problem = f"it cannot be read ({_reason(e)})"
                if problem is None:
                    return path
                warnings.warn(f"patchdsl: cached kernel {path} failed its check: {problem}; regenerating it",
                              CacheWarning, stacklevel=3)
            atomic_write(path, expected)
            return path
        except CacheError:
            raise
        except OSError as e:
            if root == _fallback:
                raise CacheError(f"cannot write kernel {key.name} to {root}: {_reason(e)}") from None
            roots.append(_fallback_root(_reason(e)))


def write_kernel(key: KernelKey, directory: Path | None = None, *, flat: bool = False) -> Path:
    """Render ``key`` and write it atomically; return the file path.

    Into the cache (default): idempotent, checked as :func:`load_kernel` does.  Into ``directory``
    with ``flat=True`` (``patchdsl codegen --out``): the file is ``<name>_<hash[:8]>.py``, so two
    kernels never share a name; an existing file with other content is never overwritten
    (:class:`CacheError`).
    """
    if directory is None and not flat:
        return _ensure_file(key)
    validate_key(key)
    digest = key_hash(key)
    root = Path(directory) if directory is not None else cache_dir()
    text = file_text(key)
    try:
        if flat:
            path = _inside(root, root / f"{key.name}_{digest[:8]}.py")
        else:
            path = _cache_path(root, key, digest)
        if path.exists():
            if path.is_file() and path.read_text(encoding="utf-8", errors="replace") == text:
                return path
            raise CacheError(f"{path} already exists with other content; not overwriting it "
                             f"(remove it or choose another folder)")
        atomic_write(path, text)
    except OSError as e:
        raise CacheError(f"cannot write kernel {key.name} to {root}: {_reason(e)}") from None
    return path


def load_kernel(key: KernelKey) -> ModuleType:
    """Return the imported generated module for ``key`` (rendering and caching it if needed)."""
    ensure_triton()
    with _lock:
        mod = _loaded.get(key.params_json() + key.template)
        if mod is not None:
            return mod
        path = _ensure_file(key)
        modname = f"patchdsl_kernels.{path.stem}"
        spec = importlib.util.spec_from_file_location(modname, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)
        except OSError as e:
            sys.modules.pop(modname, None)
            raise CacheError(f"cannot import kernel {path}: {_reason(e)}") from None
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        _loaded[key.params_json() + key.template] = mod
        return mod
