"""Reading files (and JSON / YAML text) that patchdsl did not write, and writing the files it is asked to
write: the one place that does each.

Every file named by a user is untrusted: a spec, a model's ``config.json``, ``--liger @FILE``, a
``--kernel-mapping`` file, a plan file.  :func:`read_bytes` opens it with ``O_NONBLOCK`` (a FIFO
or a device never blocks the open), checks with ``fstat`` on the open descriptor that it is a
regular file (so ``/dev/zero``, a FIFO, a socket or a folder is refused before one byte is read,
and a file swapped after a check is not what is read), and reads at most the limit of its kind
plus one byte (a file that grows while read, or a sparse 100 MB file, costs at most that).
:func:`read_text` adds a strict UTF-8 decode whose error gives the line and column of the first bad
byte, never the byte.  :func:`parse_json` / :func:`parse_yaml` bound the nesting depth (checked
before the recursive parsers run, so no ``RecursionError``) and the digits of integer literals
(no 5000-digit integer reaches ``int``).  Every failure is a :class:`FileReadError` (a
``ValueError``) whose message names the file and says what is wrong in one line; callers turn it
into their own error type (``SpecError``, ``ModelLoadError``, ``PlanError``...) or the CLI's exit 2.

Every file a command writes where the user asked (``suggest --out``, ``apply --json-out``, the census
table, bench results...) is written by :func:`write_text` / :func:`write_bytes`: the name is checked
first without opening it (:func:`check_writable`: a FIFO, a device, a folder, a socket, a link to one
of them, a missing folder or an unwritable file is a :class:`FileWriteError` naming the file, exit 2),
then the data go to a new temporary file in the same folder that is renamed over the name (nothing is
opened that could block, and no reader sees half a file).  :func:`check_folder` does the same for an
output folder.  ``tests/hostile/test_out_files.py`` fails on any other write in patchdsl or its tools.

This module imports nothing of patchdsl (the syntax layer uses it; see docs/architecture.md).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any

KiB, MiB = 1024, 1024 * 1024

# Size limit of each kind of file (bytes).  A limit is far above any real file of the kind.
LIMITS = {
    "spec": 64 * KiB,          # = syntax.includes.MAX_SPEC_BYTES
    "config": 4 * MiB,         # a model's config.json (real ones: a few KiB; Phi-3's long-rope lists ~10 KiB)
    "liger": 1 * MiB,          # --liger @FILE: a training config (JSON or YAML)
    "mapping": 1 * MiB,        # --kernel-mapping: a KernelConfig mapping
    "plan": 64 * MiB,          # a plan file (--json of plan; ~1 KiB per site)
    "json": 1 * MiB,           # JSON given as text (liger_kernel_config strings and the like)
    "table": 4 * MiB,          # a table patchdsl wrote and reads back (the census's docs/coverage.md: ~20 KiB)
}
MAX_DEPTH = 64                 # nesting of JSON / YAML objects and arrays (real configs: < 6)
MAX_INT_DIGITS = 64            # digits of one integer literal (64-bit values have at most 20)
MAX_SHOWN = 120                # characters of a path shown in a message


class FileReadError(ValueError):
    """A file (or text) that cannot be read as asked; ``str(e)`` is the one-line message.

    ``reason`` is one of ``"missing"``, ``"os"`` (permission, name too long, ...), ``"not-regular"``,
    ``"too-large"``, ``"not-utf8"``, ``"syntax"``, ``"too-deep"``, ``"big-int"``."""

    def __init__(self, message: str, reason: str, path: str = ""):
        super().__init__(message)
        self.reason = reason
        self.path = path


def show(path: Any, limit: int = MAX_SHOWN) -> str:
    """A path (or any argument) as it may appear in a message: one line, at most ``limit`` characters."""
    s = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    s = s.replace("\n", "\\n").replace("\r", "\\r").replace("\x00", "\\0")
    return s if len(s) <= limit else f"{s[:limit - 30]}... ({len(s):,} characters)"


def _os_reason(e: OSError) -> str:
    if e.errno == errno.ENAMETOOLONG:
        return "file name too long"
    return (e.strerror or type(e).__name__).lower() if e.strerror else type(e).__name__


def exists(path: Any) -> bool:
    """``os.path.exists`` that is False (not an OSError) for a name too long, a NUL byte..."""
    try:
        os.stat(path)
        return True
    except (OSError, ValueError):
        return False


def is_dir(path: Any) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_file(path: Any) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bytes(path: str | os.PathLike, kind: str, *, limit: int | None = None, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (default ``LIMITS[kind]``).

    ``what`` names the file in messages ("model config", "plan file"...)."""
    limit = LIMITS[kind] if limit is None else limit
    shown = show(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise FileReadError(f"cannot read {what} '{shown}': no such file", "missing", shown) from None
    except IsADirectoryError:
        raise FileReadError(f"cannot read {what} '{shown}': it is a folder, not a file", "not-regular", shown) from None
    except OSError as e:
        raise FileReadError(f"cannot read {what} '{shown}': {_os_reason(e)}", "os", shown) from None
    except ValueError:                      # a NUL byte in the name
        raise FileReadError(f"cannot read {what} '{shown}': the name holds a NUL character", "os", shown) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind_of = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                       else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                       else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise FileReadError(f"cannot read {what} '{shown}': it is {kind_of}, not a regular file",
                                "not-regular", shown)
        if st.st_size > limit:
            raise FileReadError(f"{what} '{shown}' is too large ({st.st_size:,} bytes; at most {limit:,})",
                                "too-large", shown)
        chunks, n = [], 0
        while n <= limit:                   # the size may have changed since fstat: read at most limit + 1
            b = os.read(fd, min(1 * MiB, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
    except OSError as e:
        raise FileReadError(f"cannot read {what} '{shown}': {_os_reason(e)}", "os", shown) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileReadError(f"{what} '{shown}' is too large (over {limit:,} bytes)", "too-large", shown)
    return data


def line_col(data: bytes, offset: int) -> tuple[int, int]:
    head = data[:offset]
    return head.count(b"\n") + 1, offset - (head.rfind(b"\n") + 1) + 1


def decode(data: bytes, where: str) -> str:
    """Strict UTF-8 (a leading BOM dropped); the error gives the position of the first bad byte."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        ln, col = line_col(data, e.start)
        raise FileReadError(f"{where} is not UTF-8 text (first bad byte at line {ln}, column {col})",
                            "not-utf8", where) from None
    return text[1:] if text.startswith("\ufeff") else text


def read_text(path: str | os.PathLike, kind: str, *, limit: int | None = None, what: str = "file") -> str:
    data = read_bytes(path, kind, limit=limit, what=what)
    return decode(data, f"{what} '{show(path)}'")


# ---------------------------------------------------------------- JSON
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)


def json_depth_at(text: str, max_depth: int) -> int | None:
    """Offset of the first bracket nesting deeper than ``max_depth`` (strings skipped), or None."""
    depth = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > max_depth:
                return m.start()
        elif c in "]}":
            depth -= 1
    return None


class _BigInt(Exception):
    pass


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise _BigInt(len(s.lstrip("-")))
    return int(s)


def parse_json(text: str, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with nesting at most ``max_depth`` and integers of at most MAX_INT_DIGITS digits."""
    import json

    at = json_depth_at(text, max_depth)
    if at is not None:
        ln = text.count("\n", 0, at) + 1
        raise FileReadError(f"{where} nests deeper than {max_depth} levels (at line {ln})", "too-deep", where)
    try:
        return json.loads(text, parse_int=_parse_int)
    except _BigInt as e:
        raise FileReadError(f"{where} holds an integer of {e.args[0]:,} digits (at most {MAX_INT_DIGITS})",
                            "big-int", where) from None
    except json.JSONDecodeError as e:
        raise FileReadError(f"{where} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                            "syntax", where) from None
    except (RecursionError, ValueError) as e:     # not reached after the checks above; kept as a net
        raise FileReadError(f"{where} cannot be read as JSON: {type(e).__name__}", "syntax", where) from None


def read_json(path: str | os.PathLike, kind: str, *, what: str = "file", max_depth: int = MAX_DEPTH) -> Any:
    return parse_json(read_text(path, kind, what=what), f"{what} '{show(path)}'", max_depth=max_depth)


# ---------------------------------------------------------------- YAML
def parse_yaml(text: str, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``yaml.safe_load`` after a pass over PyYAML's event stream (its parser is iterative, only
    the composer recurses) that bounds the nesting depth and refuses aliases (``*name``: shared
    nodes that multiply on expansion); integers are bounded as in JSON."""
    import yaml

    depth = 0
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > max_depth:
                    ln = ev.start_mark.line + 1 if ev.start_mark else 0
                    raise FileReadError(f"{where} nests deeper than {max_depth} levels (at line {ln})",
                                        "too-deep", where)
            elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
            elif isinstance(ev, yaml.AliasEvent):
                # an alias shares a node: nine nested aliases of nine make 10**9 elements for the
                # first repr or walk (the "billion laughs"); configs patchdsl reads need none
                ln = ev.start_mark.line + 1 if ev.start_mark else 0
                raise FileReadError(f"{where} uses a YAML alias (*{ev.anchor}, at line {ln}); patchdsl reads "
                                    f"YAML without anchors and aliases: write the value out", "syntax", where)
            elif isinstance(ev, yaml.ScalarEvent) and ev.style is None and not ev.tag:
                digits = ev.value.lstrip("+-").replace("_", "")
                if len(digits) > MAX_INT_DIGITS and digits.isdigit():
                    raise FileReadError(f"{where} holds an integer of {len(digits):,} digits (at most "
                                        f"{MAX_INT_DIGITS})", "big-int", where)
        return yaml.safe_load(text)
    except FileReadError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        loc = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise FileReadError(f"{where} is not valid YAML: {problem}{loc}", "syntax", where) from None
    except (RecursionError, ValueError, OverflowError) as e:   # a net: not reached after the checks above
        raise FileReadError(f"{where} cannot be read as YAML: {type(e).__name__}", "syntax", where) from None


def read_data(path: str | os.PathLike, kind: str, *, what: str = "file", max_depth: int = MAX_DEPTH) -> Any:
    """A JSON file, or YAML for a ``.yaml`` / ``.yml`` name."""
    text = read_text(path, kind, what=what)
    where = f"{what} '{show(path)}'"
    if Path(os.fspath(path)).suffix.lower() in (".yaml", ".yml"):
        return parse_yaml(text, where, max_depth=max_depth)
    return parse_json(text, where, max_depth=max_depth)


# ---------------------------------------------------------------- writing
class FileWriteError(ValueError):
    """A file that cannot be written as asked; ``str(e)`` is the one-line message.

    ``reason`` is one of ``"not-regular"`` (a folder, FIFO, device, socket, or a link to one),
    ``"no-folder"`` (its folder is missing or not a folder), ``"not-writable"``, ``"os"``."""

    def __init__(self, message: str, reason: str, path: str = ""):
        super().__init__(message)
        self.reason = reason
        self.path = path


def _kind_of(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def check_writable(path: str | os.PathLike, *, what: str = "file") -> Path:
    """The file that writing ``path`` would replace, checked without opening anything (so a FIFO
    or a device never blocks): a regular file (a link to one is followed: the file it names is
    written) or a new name in a writable folder.  :class:`FileWriteError` otherwise.  Commands call
    it before their work, :func:`write_text` again when it writes."""
    shown = show(path)
    try:
        p = os.fspath(path)
        if not p or "\x00" in p:
            raise ValueError
    except (TypeError, ValueError):
        raise FileWriteError(f"cannot write {what} '{shown}': not a file name", "os", shown) from None
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if os.path.islink(p):
            raise FileWriteError(f"cannot write {what} '{shown}': it is a symbolic link to a missing file "
                                 f"(patchdsl does not create files through links)", "not-regular", shown) from None
        st = None
    except NotADirectoryError:
        raise FileWriteError(f"cannot write {what} '{shown}': a part of its path is not a folder", "no-folder",
                             shown) from None
    except OSError as e:
        raise FileWriteError(f"cannot write {what} '{shown}': {_os_reason(e)}", "os", shown) from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            link = " (through a symbolic link)" if os.path.islink(p) else ""
            raise FileWriteError(f"cannot write {what} '{shown}': it is {_kind_of(st.st_mode)}{link}, not a regular "
                                 f"file", "not-regular", shown)
        if not os.access(p, os.W_OK):
            raise FileWriteError(f"cannot write {what} '{shown}': permission denied (the file is not writable)",
                                 "not-writable", shown)
        target = Path(os.path.realpath(p))
    else:
        target = Path(os.path.abspath(p))
    folder = target.parent
    try:
        fst = os.stat(folder)
    except FileNotFoundError:
        raise FileWriteError(f"cannot write {what} '{shown}': its folder does not exist ({show(folder)})",
                             "no-folder", shown) from None
    except OSError as e:
        raise FileWriteError(f"cannot write {what} '{shown}': {_os_reason(e)}", "os", shown) from None
    if not stat.S_ISDIR(fst.st_mode):
        raise FileWriteError(f"cannot write {what} '{shown}': '{show(folder)}' is not a folder", "no-folder", shown)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FileWriteError(f"cannot write {what} '{shown}': permission denied (its folder '{show(folder)}' is "
                             f"not writable)", "not-writable", shown)
    _probe(folder, what, shown)
    return target


def _probe(folder: Path, what: str, shown: str) -> None:
    """Make and remove a new file in ``folder``: the one sure test that a file can be written there
    (``os.access`` says yes to root on a read-only or pseudo file system such as /proc)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=".patchdsl-probe.", dir=folder)
    except OSError as e:
        raise FileWriteError(f"cannot write {what} '{shown}': no new file can be made in its folder "
                             f"'{show(folder)}' ({_os_reason(e)})", "not-writable", shown) from None
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass


def check_folder(path: str | os.PathLike, *, what: str = "folder", create: bool = True) -> Path:
    """A folder files will be written into: an existing folder (a link to one is followed) or, with
    ``create``, a new one made here (parents too).  A file, FIFO or device there is refused;
    :class:`FileWriteError` otherwise."""
    shown = show(path)
    try:
        p = Path(os.fspath(path))
        st = os.stat(p)
    except FileNotFoundError:
        if not create:
            raise FileWriteError(f"cannot write into {what} '{shown}': no such folder", "no-folder", shown) from None
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FileWriteError(f"cannot create {what} '{shown}': {_os_reason(e)}", "os", shown) from None
        st = os.stat(p)
    except (OSError, ValueError, TypeError) as e:
        reason = _os_reason(e) if isinstance(e, OSError) else "not a folder name"
        raise FileWriteError(f"cannot write into {what} '{shown}': {reason}", "os", shown) from None
    if not stat.S_ISDIR(st.st_mode):
        raise FileWriteError(f"cannot write into {what} '{shown}': it is {_kind_of(st.st_mode)}, not a folder",
                             "not-regular", shown)
    if not os.access(p, os.W_OK | os.X_OK):
        raise FileWriteError(f"cannot write into {what} '{shown}': permission denied", "not-writable", shown)
    return p


def write_bytes(path: str | os.PathLike, data: bytes, *, what: str = "file", private: bool = False,
                parents: bool = False) -> Path:
    """Write ``data`` to ``path``: the one writer of files patchdsl is asked to write.

    Checked first (:func:`check_writable`: no FIFO, device, folder, socket, link to one, missing
    folder, unwritable file), then written to a new temporary file in the same folder (``mkstemp``:
    a new regular file, so nothing blocks) and renamed over the name: a reader sees the old file or
    the new one, never half of one, and a name swapped for a FIFO after the check is replaced, not
    opened.  The file keeps the mode of the file it replaces; a new one gets the usual ``0666``
    less the umask (``private``: ``0600``).  ``parents``: a missing folder is made (:func:`check_folder`).
    Returns the path written."""
    import tempfile

    if parents:
        check_folder(Path(os.path.abspath(os.fspath(path))).parent, what=f"the folder of {what}")
    target = check_writable(path, what=what)
    shown = show(path)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        if private:
            mode = 0o600
        else:
            umask = os.umask(0o022)
            os.umask(umask)
            mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:60]}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise FileWriteError(f"cannot write {what} '{shown}': no new file can be made in its folder "
                             f"'{show(target.parent)}' ({_os_reason(e)})", "not-writable", shown) from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise FileWriteError(f"cannot write {what} '{shown}': {_os_reason(e)}", "os", shown) from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def write_text(path: str | os.PathLike, text: str, *, what: str = "file", private: bool = False,
               parents: bool = False) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(path, text.encode("utf-8"), what=what, private=private, parents=parents)


def stdout_to_devnull() -> None:
    """Point the process's stdout at /dev/null (its reader went away: what is still buffered must not
    fail at exit); nothing when stdout is not a real file (click's test runner)."""
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
