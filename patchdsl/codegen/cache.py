"""The on-disk kernel cache: the one place codegen writes files and imports them.

Path: ``<cache>/<hash[:2]>/<name>_<hash[:16]>.py`` where the hash covers the template text,
the parameters, the patchdsl version and the Triton version.  Files are written to a temporary
name in the same folder and ``os.replace``d, so concurrent writers never leave a torn file.

Safety (docs/reliability.md):

* The cache folder is created private (mode 0700).  A folder owned by another user, or
  writable by group or others, is refused with :class:`CacheError` (code imported from it could
  have been planted); nothing is imported from it.  Every parent folder of the cache, up to
  ``/``, must be owned by the user or root and not writable by others unless it has the sticky
  bit (``/tmp``), as compiler caches check.
* Every cached file starts with ``# patchdsl-sha256: <hex>``, the sha256 of the rest of the file.
  A kernel file is opened once without following links (``O_NOFOLLOW``); it must be a regular
  file owned by the user and not writable by group or others; its bytes are read once, and the
  hash line is checked against them and they against the text this version renders for the key.
  A file that fails (truncated, half written, edited, planted, a link, another owner, mode 0666)
  is regenerated with a warning.
* What runs is exactly the text that was checked: it is ``compile()``d and exec'd into a fresh
  module; the import system is never used for cache kernels, so no ``__pycache__/*.pyc`` is
  read or written.  Triton's ``@jit`` reads a function's source through ``inspect`` /
  ``linecache``: the checked text is registered in ``linecache`` under the file's name (an entry
  that is never revalidated against the disk) and served by the module's loader, and under the
  interpreter each kernel's source rewrite is done at load, so Triton never re-reads the file.
* A cache folder that cannot be written (read-only, full disk, no permission) falls back, with a
  warning, to a private temporary folder (``tempfile.mkdtemp``) for the rest of the process.
  No raw ``OSError`` reaches the caller: what cannot be recovered is a :class:`CacheError`.
* Kernel names are validated (``[A-Za-z0-9_]+``) and every path is checked to stay inside the
  cache folder.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import linecache
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
def _my_uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def check_private(folder: Path) -> None:
    """Raise CacheError unless ``folder`` is a directory owned by this user and not writable by
    group or others."""
    try:
        st = os.stat(folder)
    except OSError as e:
        raise CacheError(f"cannot inspect the kernel cache folder {folder}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"the kernel cache path {folder} is not a folder")
    uid = _my_uid()
    if uid is not None and st.st_uid != uid:
        raise CacheError(
            f"the kernel cache folder {folder} is owned by uid {st.st_uid}, not by you (uid {uid}): "
            f"patchdsl will not import code from it; set PATCHDSL_CACHE to a folder of your own")
    if st.st_mode & 0o022:
        raise CacheError(
            f"the kernel cache folder {folder} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"anyone could plant code there; run 'chmod 700 {folder}' or set PATCHDSL_CACHE to a private folder")


def _ancestors(folder: Path) -> list[Path]:
    """The parents of ``folder`` up to ``/``, both as written and with links resolved (a link's
    own folder decides who can change it; the resolved chain who can change its target)."""
    out: list[Path] = []
    for p in (Path(os.path.abspath(folder)), Path(os.path.realpath(folder))):
        for parent in p.parents:
            if parent not in out:
                out.append(parent)
    return out


def check_parents(folder: Path) -> None:
    """Raise CacheError unless every existing parent folder of ``folder`` up to ``/`` is owned by
    this user or root and is not writable by others unless its sticky bit is set (``/tmp``):
    whoever can rename entries in a parent can swap the cache folder for their own.
    Group-writable parents are accepted (many systems give each user a private group; what runs
    is checked byte for byte anyway); the cache folder itself must not be."""
    uid = _my_uid()
    if uid is None:                         # no POSIX ownership (Windows)
        return
    for parent in _ancestors(folder):
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue                        # not made yet: it will be, by us, mode 0700
        except OSError as e:
            raise CacheError(f"cannot inspect {parent}, a parent of the kernel cache folder {folder}: "
                             f"{e.strerror or e}") from None
        if st.st_uid not in (uid, 0):
            raise CacheError(
                f"{parent}, a parent of the kernel cache folder {folder}, is owned by uid {st.st_uid}, neither you "
                f"(uid {uid}) nor root: its owner could replace the cache; set PATCHDSL_CACHE to a folder "
                f"inside your own home")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise CacheError(
                f"{parent}, a parent of the kernel cache folder {folder}, is writable by others without the "
                f"sticky bit (mode {stat.S_IMODE(st.st_mode):04o}): anyone could replace the cache; run "
                f"'chmod o-w {parent}' (or 'chmod +t' for a shared folder) or set PATCHDSL_CACHE to a private folder")


def _make_private(folder: Path, *, root: bool = False) -> None:
    """Create ``folder`` (0700) if needed and check it; for the cache root, its parents are
    checked before anything is made and again after, and missing ones are made 0700 too.
    OSError for an unwritable place."""
    if folder in _checked:
        return
    if root:
        check_parents(folder)
        for parent in reversed(Path(os.path.abspath(folder)).parents):
            if not parent.exists():
                parent.mkdir(mode=0o700, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if root:
        check_parents(folder)
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
    # the folder is resolved, not the file: a link planted as the file is the reader's to refuse
    r, p = root.resolve(), path.parent.resolve() / path.name
    if path.name in ("", ".", "..") or (p.parent != r and r not in p.parents):
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


def read_checked(path: Path, expected: str | None = None) -> tuple[str | None, str | None]:
    """Read a kernel file once and check it: ``(text, None)`` when it is a regular file (not a
    link) owned by this user, not writable by group or others, UTF-8, with a matching sha256 line
    (and equal to ``expected`` when given); else ``(None, what is wrong)``.  FileNotFoundError
    when there is no file.  With ``expected``, no more than its length (+1) is read."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno != errno.ENOENT and os.path.islink(path)):
            return None, "it is a symbolic link (kernel files are never followed through links)"
        if e.errno == errno.ENOENT:
            raise
        return None, f"it cannot be read ({_reason(e)})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "it is not a regular file"
        uid = _my_uid()
        if uid is not None and st.st_uid != uid:
            return None, f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
        if st.st_mode & 0o022:
            return None, f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
        limit = len(expected.encode()) + 1 if expected is not None else None
        chunks, n = [], 0
        while limit is None or n < limit:
            b = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
    except OSError as e:
        return None, f"it cannot be read ({_reason(e)})"
    finally:
        os.close(fd)
    if limit is not None and n >= limit:
        return None, "it is longer than what this version renders for the key"
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        return None, "it is not UTF-8 text"
    problem = check_text(text, expected)
    return (text, None) if problem is None else (None, problem)


def _ensure_file(key: KernelKey) -> tuple[Path, str]:
    """The verified cache file for ``key`` and its checked text: written if missing, regenerated
    if it fails its check, in the user's cache or (if that cannot be written) the private
    fallback folder."""
    validate_key(key)
    digest = key_hash(key)
    expected = file_text(key)
    roots = [cache_dir()] if _fallback is None else [_fallback]
    while True:
        root = roots[-1]
        try:
            _make_private(root, root=True)
            path = _cache_path(root, key, digest)
            _make_private(path.parent)
            try:
                text, problem = read_checked(path, expected)
            except FileNotFoundError:
                text, problem = None, None
            if text is not None:
                return path, text
            if problem is not None:
                warnings.warn(f"patchdsl: cached kernel {path} failed its check: {problem}; it is not imported "
                              f"and is replaced by a freshly generated file", CacheWarning, stacklevel=3)
            atomic_write(path, expected)
            return path, expected
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
        return _ensure_file(key)[0]
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


class _VerifiedSource(importlib.abc.InspectLoader):
    """Loader of a cache kernel: runs, and serves as its source, the text that was checked."""

    def __init__(self, filename: str, text: str):
        self.filename, self.text = filename, text

    def create_module(self, spec):
        return None

    def get_source(self, fullname: str) -> str:
        return self.text

    def is_package(self, fullname: str) -> bool:
        return False

    def get_code(self, fullname: str):
        # dont_inherit: the __future__ imports of this file must not reach the kernel
        return compile(self.text, self.filename, "exec", dont_inherit=True)

    def exec_module(self, module: ModuleType) -> None:
        # Triton's @jit reads the function's source through inspect -> linecache when it decorates
        # (and the interpreter again when it first runs it): the checked text goes in first, as an
        # entry with no mtime, which linecache.checkcache never revalidates against the disk.
        linecache.cache[self.filename] = (len(self.text), None, self.text.splitlines(True), self.filename)
        exec(self.get_code(module.__name__), module.__dict__)


def _rewrite_now(mod: ModuleType) -> None:
    """Under Triton's interpreter, rewrite each kernel of ``mod`` now (the interpreter reads the
    source at the first call otherwise, by then possibly from the disk if ``linecache`` was
    cleared).  On a GPU ``@jit`` read the source at decoration, inside the exec."""
    interp = sys.modules.get("triton.runtime.interpreter")   # not imported: no interpreted kernel exists
    InterpretedFunction = getattr(interp, "InterpretedFunction", None)
    if InterpretedFunction is None:
        return
    for val in list(vars(mod).values()):
        for _ in range(4):                  # through autotune / heuristics wrappers (.fn)
            if isinstance(val, InterpretedFunction):
                if getattr(val.fn, "__module__", None) == mod.__name__ and hasattr(val, "rewrite"):
                    val.rewrite()
                break
            val = getattr(val, "fn", None)
            if val is None:
                break


def load_kernel(key: KernelKey) -> ModuleType:
    """Return the generated module for ``key`` (rendering and caching it if needed), built from
    exactly the text that was checked (never through the import system, never from a ``.pyc``)."""
    ensure_triton()
    with _lock:
        mod = _loaded.get(key.params_json() + key.template)
        if mod is not None:
            return mod
        path, text = _ensure_file(key)
        modname = f"patchdsl_kernels.{path.stem}"
        loader = _VerifiedSource(str(path), text)
        spec = importlib.machinery.ModuleSpec(modname, loader, origin=str(path))
        mod = importlib.util.module_from_spec(spec)
        mod.__file__, mod.__cached__ = str(path), None      # no bytecode file, ever
        sys.modules[modname] = mod
        try:
            loader.exec_module(mod)
            _rewrite_now(mod)
        except BaseException:
            sys.modules.pop(modname, None)
            raise
        _loaded[key.params_json() + key.template] = mod
        return mod
