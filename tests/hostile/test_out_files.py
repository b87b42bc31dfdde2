"""Every file patchdsl writes goes through one writer that never blocks and refuses what is not a file
(issue 38: ``suggest --out FIFO`` and ``census --out FIFO`` hung; ``census --out`` to a folder or an
unwritable file was an internal error).

* The code: patchdsl and its tools write files only in ``patchdsl/util/files.py`` (and the kernel
  cache, ``patchdsl/codegen/cache.py``, whose private folder and link rules are its own): any other
  ``open(..., "w")``, ``write_text``, ``savefig``, ``os.replace``... fails the scan.
* The options: every output option of the command line and the tools (found in their source: click
  options and argparse arguments named ``--out``, ``--*-out``, ``--json``, ``--png``, ``--txt``) has a
  row in ``OUTPUTS`` (a new one fails until it has), and each is given a FIFO, a character device, a
  folder (a file for a folder option), a link to a FIFO and a place where no file can be made: exit 2
  with one line naming the problem, under an alarm (a hang fails instead of hanging CI).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import re
import select
import stat
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchdsl.cli import main

from .test_hostile_inputs import no_hang, one_line

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (ROOT / "patchdsl", ROOT / "tools" / "patchdsl_tools")
# the writers: the one writer, and the kernel cache's own (mkstemp + os.replace in its private 0700
# folder; a link planted there is replaced, never followed)
WRITERS = {ROOT / "patchdsl" / "util" / "files.py", ROOT / "patchdsl" / "codegen" / "cache.py"}
WRITE_CALLS = {"write_text", "write_bytes", "savefig", "mkstemp", "NamedTemporaryFile", "copyfile",
               "copy", "copy2", "copytree", "move", "rename", "replace", "to_csv", "mkdir", "makedirs",
               "symlink", "link", "truncate"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}


def _mode_writes(node: ast.Call) -> bool:
    mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    return not isinstance(mode, ast.Constant) or any(c in str(mode.value) for c in "wax+")


def _into_memory(node: ast.Call) -> bool:
    """``fig.savefig(buf := io.BytesIO(), ...)``: the first argument is a new in-memory buffer."""
    a = node.args[0] if node.args else None
    a = a.value if isinstance(a, ast.NamedExpr) else a
    return (isinstance(a, ast.Call) and isinstance(a.func, (ast.Attribute, ast.Name))
            and getattr(a.func, "attr", getattr(a.func, "id", "")) in ("BytesIO", "StringIO"))


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def file_writes(path: Path) -> list[str]:
    """``file:line what`` of every call in ``path`` that may write a file."""
    found = []
    for node in ast.walk(parsed(path)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        hit = None
        if base == "files" or _into_memory(node):     # patchdsl.util.files: the writer; io.BytesIO: memory
            continue
        if name == "open" and base in ("", "io", "builtins", "codecs") and _mode_writes(node):
            hit = "open(..., write mode)"
        elif name == "open" and base == "os" and any(isinstance(n, ast.Attribute) and n.attr in WRITE_FLAGS
                                                     for a in node.args[1:2] for n in ast.walk(a)):
            hit = "os.open(..., write flags)"
        elif name == "fdopen" and _mode_writes(node):
            hit = "os.fdopen(..., write mode)"
        elif name == "save" and base in ("torch", "np", "numpy"):
            hit = f"{base}.save"
        elif name in WRITE_CALLS and not (name in ("replace", "copy", "link") and base not in ("os", "shutil")):
            hit = name
        if hit:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            found.append(f"{where}:{node.lineno} {hit}")
    return found


def test_the_write_scan_finds_what_it_looks_for(tmp_path):
    forms = ["open(p, 'w')", "open(p, mode='a')", "open(p, m)", "Path(p).write_text(t)", "p.write_bytes(b)",
             "fig.savefig(p)", "os.replace(a, b)", "shutil.copy(a, b)", "tempfile.mkstemp()", "p.mkdir()",
             "os.open(p, os.O_WRONLY | os.O_CREAT)", "os.fdopen(fd, 'w')", "torch.save(t, p)", "os.rename(a, b)"]
    for i, src in enumerate(forms):
        p = tmp_path / f"probe_{i}.py"
        p.write_text(src + "\n")
        assert file_writes(p), src
    p = tmp_path / "clean.py"
    p.write_text("open(p)\nopen(p, 'rb')\ns.replace('a', 'b')\nos.open(p, os.O_RDONLY)\nd.copy()\n"
                 "files.write_text(p, t)\nfig.savefig(buf := io.BytesIO())\n")
    assert not file_writes(p)


def test_only_the_writer_writes_files():
    offenders = [e for d in SCANNED for p in sorted(d.rglob("*.py")) if p not in WRITERS for e in file_writes(p)]
    assert not offenders, ("files are written only by patchdsl.util.files (write_text / write_bytes / check_folder: "
                           "no FIFO, device or folder, never blocking); use it instead:\n  " + "\n  ".join(offenders))


# ---------------------------------------------------------------- every output option
OUT_OPTION = re.compile(r"^--(\w+-)?out$|^--(json|png|txt)$")


def output_options() -> set[tuple[str, str]]:
    """(file, "command option") of every click option / argparse argument of an output file or folder in
    patchdsl and its tools, found in the source (flags left out); the command is the decorated function
    (click) or the parser's variable (argparse)."""
    found = set()
    for d in SCANNED:
        for p in sorted(d.rglob("*.py")):
            tree = parsed(p)
            owner = {id(n): fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                     for dec in fn.decorator_list for n in ast.walk(dec)}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("option", "add_argument")):
                    continue
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                kw = {k.arg: k.value for k in node.keywords}
                flag = (isinstance(kw.get("is_flag"), ast.Constant) and kw["is_flag"].value is True
                        or isinstance(kw.get("action"), ast.Constant) and str(kw["action"].value).startswith("store_"))
                opts = [n for n in names if n.startswith("--")]
                if opts and not flag and any(OUT_OPTION.match(n) for n in opts):
                    v = node.func.value
                    who = owner.get(id(node)) or (v.id if isinstance(v, ast.Name) else "?")
                    found.add((str(p.relative_to(ROOT)), f"{who} {opts[0]}"))
    return found


CLI = "patchdsl/cli"
BENCH = "tools/patchdsl_tools/bench"
# (file, "command option") -> (how to run it: argv with {t} for the target, whether it names a folder)
OUTPUTS = {
    (f"{CLI}/commands.py", "suggest_cmd --out"): (["suggest", "--model", "{cfg}", "--out", "{t}"], False),
    (f"{CLI}/commands.py", "codegen --out"): (["codegen", "qwen3", "--model", "{cfg}", "--out", "{t}"], True),
    (f"{CLI}/commands.py", "census_cmd --out"): (["census", "llama", "--no-verify", "--out", "{t}"], False),
    (f"{CLI}/run.py", "apply --json-out"): (["apply", "qwen3", "--model", "{cfg}", "--json-out", "{t}"], False),
    ("tools/patchdsl_tools/census.py", "ap --out"): (["census:", "llama", "--no-verify", "--out", "{t}"], False),
    (f"{BENCH}/cli.py", "o --out"): (["bench", "ops", "--out", "{t}"], True),
    (f"{BENCH}/cli.py", "o --json-out"): (["bench", "ops", "--json-out", "{t}"], False),
    (f"{BENCH}/cli.py", "o --png"): (["bench", "ops", "--png", "{t}"], False),
    (f"{BENCH}/cli.py", "e --out"): (["bench", "e2e", "--out", "{t}"], True),
    (f"{BENCH}/cli.py", "e --json-out"): (["bench", "e2e", "--json-out", "{t}"], False),
    (f"{BENCH}/cli.py", "e --png"): (["bench", "e2e", "--png", "{t}"], False),
    (f"{BENCH}/cli.py", "g --png"): (["bench", "plot", "{cfg}", "--png", "{t}"], False),
    (f"{BENCH}/specialise.py", "s --out"): (["bench", "specialise", "--out", "{t}"], True),
    (f"{BENCH}/specialise.py", "s --json-out"): (["bench", "specialise", "--json-out", "{t}"], False),
    (f"{BENCH}/specialise.py", "s --txt"): (["bench", "specialise", "--txt", "{t}"], False),
    (f"{BENCH}/fsdp2.py", "p --out"): (["fsdp2:", "--out", "{t}"], False),
    ("patchdsl/parity/tensor_parallel.py", "ap --json"): (["tp:", "--family", "llama", "--spec", "llama", "--json", "{t}"],
                                                          False),
}


def test_every_output_option_has_a_row():
    found = output_options()
    assert found == set(OUTPUTS), (f"output options without a row in OUTPUTS (add one: how to run it): "
                                   f"{sorted(found - set(OUTPUTS))}; rows whose option is gone: "
                                   f"{sorted(set(OUTPUTS) - found)}")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("targets")
    os.mkfifo(d / "fifo")
    os.symlink(d / "fifo", d / "link-to-fifo")
    (d / "folder").mkdir()
    (d / "file").write_text("keep me\n")
    cfg = d / "config.json"
    from ..families import tiny_config

    cfg.write_text(tiny_config("qwen3").to_json_string())
    return {"fifo": d / "fifo", "chardev": Path("/dev/null"), "folder": d / "folder", "file": d / "file",
            "link-to-fifo": d / "link-to-fifo", "cfg": cfg,
            # a name in a folder where no file can be made (for root too: /proc is a pseudo file system)
            "no-new-file": Path("/proc/version")}


FILE_TARGETS = ("fifo", "chardev", "folder", "link-to-fifo", "no-new-file")
FOLDER_TARGETS = ("fifo", "chardev", "file", "link-to-fifo")
CASES = [(k, t) for k, (_, folder) in OUTPUTS.items() for t in (FOLDER_TARGETS if folder else FILE_TARGETS)]


def _run(argv: list[str]) -> tuple[int, str]:
    if argv[0] in ("census:", "fsdp2:", "tp:"):    # a tool's own entry point (python -m patchdsl_tools..., torchrun -m)
        import contextlib
        import io

        if argv[0] == "census:":
            from patchdsl_tools.census import main as tool
        elif argv[0] == "tp:":
            from patchdsl.parity.tensor_parallel import main as tool
        else:
            from patchdsl_tools.bench.fsdp2 import main as tool
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            code = tool(argv[1:])
        return code, err.getvalue()
    r = CliRunner().invoke(main, argv)
    return r.exit_code, (r.stderr if r.stderr_bytes is not None else "") + r.output


@contextlib.contextmanager
def fifo_watchdog(fifo: Path, seconds: float = 30):
    """After ``seconds``, open ``fifo`` for reading and drain it: a writer blocked opening it goes on,
    so a regression fails the test instead of hanging it (an alarm is not enough: the census sets and
    clears SIGALRM for its own time limit).  Yields a list that is non-empty when it had to."""
    fired: list[bool] = []

    def unblock():
        fired.append(True)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            end = time.monotonic() + 30
            while time.monotonic() < end:
                if select.select([fd], [], [], 0.5)[0] and not os.read(fd, 1 << 16):
                    if time.monotonic() > end - 25:       # EOF after the writer opened and closed
                        break
        finally:
            os.close(fd)

    timer = threading.Timer(seconds, unblock)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


@pytest.mark.parametrize("key, target", CASES, ids=[f"{k[1]}-{t}" for k, t in CASES])
def test_an_output_that_is_not_a_file_is_refused_at_once(key, target, targets):
    argv, folder = OUTPUTS[key]
    t = targets[target]
    before = t.read_text() if target == "file" else None
    with no_hang(120), fifo_watchdog(targets["fifo"]) as fired:
        code, out = _run([a.format(t=t, cfg=targets["cfg"]) for a in argv])
    assert not fired, f"it blocked opening the FIFO (exit {code}): {out[-1000:]}"
    assert code == 2, (code, out[-1500:])
    one_line(out)
    want = {"fifo": "FIFO", "link-to-fifo": "FIFO", "chardev": "device", "folder": "folder",
            "file": "not a folder", "no-new-file": "no new file can be made|permission denied"}[target]
    assert re.search(want, out), out[-1500:]
    if before is not None:
        assert t.read_text() == before
    assert stat.S_ISFIFO(os.lstat(targets["fifo"]).st_mode)     # never replaced either


# ---------------------------------------------------------------- the writer itself
def test_the_writer_replaces_a_file_whole_keeping_its_mode_and_follows_a_link_to_a_file(tmp_path):
    from patchdsl.util import files

    p = tmp_path / "out.txt"
    p.write_text("old\n")
    os.chmod(p, 0o640)
    files.write_text(p, "new\n")
    assert p.read_text() == "new\n" and stat.S_IMODE(os.stat(p).st_mode) == 0o640
    link = tmp_path / "link.txt"
    os.symlink(p, link)
    files.write_text(link, "through the link\n")
    assert os.path.islink(link) and p.read_text() == "through the link\n"
    fresh = files.write_text(tmp_path / "new.txt", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o666 & ~umask
    assert sorted(x.name for x in tmp_path.iterdir()) == ["link.txt", "new.txt", "out.txt"]   # no temporary left


def test_a_name_swapped_for_a_fifo_after_the_check_is_replaced_not_opened(tmp_path, monkeypatch):
    from patchdsl.util import files

    p = tmp_path / "out.txt"
    real = files.check_writable

    def check_then_swap(path, **kw):
        target = real(path, **kw)
        os.mkfifo(p)                    # the race: a FIFO appears between the check and the write
        return target

    monkeypatch.setattr(files, "check_writable", check_then_swap)
    with no_hang(30):
        files.write_text(p, "data\n")
    assert stat.S_ISREG(os.lstat(p).st_mode) and p.read_text() == "data\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes files whatever their mode")
def test_an_unwritable_file_is_refused(tmp_path):
    from patchdsl.util import files

    p = tmp_path / "ro.txt"
    p.write_text("keep\n")
    os.chmod(p, 0o444)
    with pytest.raises(files.FileWriteError, match="permission denied"):
        files.write_text(p, "x")
    assert p.read_text() == "keep\n"
