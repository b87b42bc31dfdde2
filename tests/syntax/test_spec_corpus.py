"""A corpus of hostile specs, run as a table: each gives a located SpecError (or, marked ``ok``,
plans), and none takes more than 2 s of CPU time.

Static cases are ``tests/corpus/*.kpatch``; the first line says what must happen:
``# expect: LINE:COL message fragment`` (one of the errors must be at that place and say that)
or ``# expect: ok``; ``# model: qwen3`` plans the spec against a tiny Qwen3 (meta device).
Generated cases (too big or too odd to commit: include chains, FIFOs, binary files, links) are
built in a temporary folder by ``GENERATED``.

The time bound is the corpus runner's own watchdog (CPU time, so a busy machine does not trip
it): a case still running after 2 s fails with "took longer than 2 s".
"""

from __future__ import annotations

import os
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from patchdsl.planning.check import check_loaded
from patchdsl.syntax import SpecError, load_spec
from patchdsl.syntax.includes import MAX_INCLUDE_DEPTH, MAX_INCLUDES
from patchdsl.syntax.parser import MAX_RULES, read_spec

CORPUS = Path(__file__).parents[1] / "corpus"
LIMIT_S = 2.0


class _Slow(BaseException):
    pass


@contextmanager
def watchdog(what: str, seconds: float = LIMIT_S):
    """Fail with 'took longer than 2 s' if the block uses more than ``seconds`` of CPU time."""
    if not hasattr(signal, "setitimer"):  # pragma: no cover - not on this platform
        yield
        return

    def fire(*_):
        raise _Slow()

    old = signal.signal(signal.SIGPROF, fire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    except _Slow:
        pytest.fail(f"{what} took longer than {seconds:g} s")
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


@pytest.fixture(scope="module")
def qwen3_index():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from patchdsl.model.index import build_index

    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return build_index(model)


def _run(load, index=None):
    """Load (and plan, given an index) under the watchdog; the SpecError or None."""
    from patchdsl.planning.plan import plan_index

    try:
        checked = check_loaded(load)
        if index is not None:
            plan_index(checked, index, target="interpreter")
    except SpecError as e:
        return e
    return None


def _assert_located(e: SpecError | None, line: int, col: int, fragment: str, name: str) -> None:
    assert e is not None, f"{name}: no error"
    rendered = e.render()
    assert "Traceback" not in rendered
    hits = [one for one in e.errors if one.span is not None and fragment in one.render_one()
            and (line is None or (one.span.line, one.span.col) == (line, col))]
    assert hits, f"{name}: expected an error at {line}:{col} saying {fragment!r}; got:\n{rendered}"


STATIC = sorted(CORPUS.glob("*.kpatch"))


@pytest.mark.parametrize("path", STATIC, ids=[p.stem for p in STATIC])
def test_static_corpus(path, request):
    head = path.read_bytes().split(b"\n", 3)
    expect = re.match(r"# expect: (ok|(\d+):(\d+) (.*))$", head[0].decode())
    assert expect, f"{path.name}: first line must be '# expect: ...'"
    model = any(h.strip() == b"# model: qwen3" for h in head[1:3]) or b"\n# model: qwen3" in path.read_bytes()
    index = request.getfixturevalue("qwen3_index") if model else None
    with watchdog(path.name):
        e = _run(lambda: read_spec(path), index)
    if expect.group(1) == "ok":
        assert e is None, e.render()
    else:
        _assert_located(e, int(expect.group(2)), int(expect.group(3)), expect.group(4), path.name)
        assert all(one.span is not None for one in e.errors), e.render()


# ---------------------------------------------------------------------------- generated cases
SECRET = "TOP-SECRET-0xC0FFEE"


def _chain(tmp: Path, n: int) -> Path:
    for i in range(n):
        (tmp / f"c{i}.kpatch").write_text(f'include "c{i + 1}.kpatch"\n' if i + 1 < n else "*.mlp: SwiGLU -> fused_swiglu\n")
    return tmp / "c0.kpatch"


def _doubling(tmp: Path, n: int = 17) -> Path:
    for i in range(n):
        body = f'include "d{i + 1}.kpatch"\ninclude "d{i + 1}.kpatch"\n' if i + 1 < n else "*.mlp: SwiGLU -> fused_swiglu\n"
        (tmp / f"d{i}.kpatch").write_text(body)
    return tmp / "d0.kpatch"


def _many_rules(tmp: Path) -> Path:
    p = tmp / "many.kpatch"
    p.write_text("".join(f"model.layers.{i}.mlp: SwiGLU -> fused_swiglu\n" for i in range(MAX_RULES + 100)))
    return p


def _huge(tmp: Path) -> Path:
    p = tmp / "huge.kpatch"
    p.write_text("*.mlp: SwiGLU -> fused_swiglu\n" * 100_000)
    return p


def _binary_include(tmp: Path) -> Path:
    (tmp / "bin.kpatch").write_bytes(bytes(range(256)) + SECRET.encode())
    (tmp / "top.kpatch").write_text('\ninclude "bin.kpatch"\n')
    return tmp / "top.kpatch"


def _latin1_include(tmp: Path) -> Path:
    (tmp / "l1.kpatch").write_bytes(("# " + SECRET + "\n*.mlp: SwiGLU -> fused_swiglu # caf\xe9\n").encode("latin-1"))
    (tmp / "top.kpatch").write_text('include "l1.kpatch"\n')
    return tmp / "top.kpatch"


def _secret_txt(tmp: Path) -> Path:
    (tmp / "secret.txt").write_text(SECRET + ": x -> y\n")
    (tmp / "top.kpatch").write_text('include "secret.txt"\n')
    return tmp / "top.kpatch"


def _link_out(tmp: Path) -> Path:
    out = tmp / "outside"
    out.mkdir()
    (out / "secret.kpatch").write_text(SECRET + " garbage\n")
    inner = tmp / "specs"
    inner.mkdir()
    (inner / "link.kpatch").symlink_to(out / "secret.kpatch")
    (inner / "top.kpatch").write_text('include "link.kpatch"\n')
    return inner / "top.kpatch"


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "pipe.kpatch")
    (tmp / "top.kpatch").write_text('include "pipe.kpatch"\n')
    return tmp / "top.kpatch"


def _folder(tmp: Path) -> Path:
    (tmp / "dir.kpatch").mkdir()
    (tmp / "top.kpatch").write_text('include "dir.kpatch"\n')
    return tmp / "top.kpatch"


def _cycle(tmp: Path) -> Path:
    (tmp / "a.kpatch").write_text('include "b.kpatch"\n')
    (tmp / "b.kpatch").write_text('*.mlp: SwiGLU -> fused_swiglu\ninclude "a.kpatch"\n')
    return tmp / "a.kpatch"


# (name, builder, file name of the error's location, line, col, fragment)
GENERATED = [
    ("include chain of 1000", lambda t: _chain(t, 1000), f"c{MAX_INCLUDE_DEPTH}.kpatch", 1, 9,
     "includes nest too deep"),
    ("17 files each including the next twice", _doubling, None, None, None, f"too many includes (at most {MAX_INCLUDES}"),
    ("too many rules", _many_rules, "many.kpatch", MAX_RULES + 1, 1, "too many rules"),
    ("100k rules", _huge, "huge.kpatch", 1, 1, "too large for a spec"),
    ("binary include", _binary_include, "top.kpatch", 2, 9, "is not a spec: it is not UTF-8 text"),
    ("latin-1 include", _latin1_include, "top.kpatch", 1, 9, "is not a spec: it is not UTF-8 text"),
    ("include of a .txt", _secret_txt, "top.kpatch", 1, 9, "only *.kpatch files can be included"),
    ("link out of the folder", _link_out, "top.kpatch", 1, 9, "outside the folders includes may read"),
    ("include cycle", _cycle, "b.kpatch", 2, 9, "include cycle: a.kpatch -> b.kpatch -> a.kpatch"),
    ("include of a folder", _folder, "top.kpatch", 1, 9, "is not a regular file"),
]
if hasattr(os, "mkfifo"):
    GENERATED.append(("include of a FIFO", _fifo, "top.kpatch", 1, 9, "is not a regular file"))


@pytest.mark.parametrize("name,build,file,line,col,fragment", GENERATED, ids=[g[0] for g in GENERATED])
def test_generated_corpus(tmp_path, name, build, file, line, col, fragment):
    path = build(tmp_path)
    with watchdog(name):
        e = _run(lambda: load_spec(path))
    _assert_located(e, line, col, fragment, name)
    if file is not None:
        assert any(one.span.file.endswith(file) for one in e.errors if one.span), e.render()
    assert SECRET not in e.render()


@pytest.mark.parametrize("target", ["/etc/shadow", "/proc/self/environ", "/etc/passwd"])
def test_system_files_never_echoed(tmp_path, target):
    """Naming a system file directly (API or include) is refused before anything is read."""
    with watchdog(target):
        e = _run(lambda: load_spec(Path(target)))
    assert e is not None and "not a spec file" in e.render()
    (tmp_path / "top.kpatch").write_text(f'include "{target}"\n')
    e = _run(lambda: load_spec(tmp_path / "top.kpatch"))
    _assert_located(e, 1, 9, "outside the folders includes may read", target)
    if os.path.exists(target) and os.access(target, os.R_OK):
        content = Path(target).read_bytes()[:200].decode("utf-8", "replace")
        first = next((ln for ln in content.replace("\0", "\n").split("\n") if len(ln) > 8), None)
        if first:
            assert first not in e.render()


def test_include_dirs_allow_a_folder(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "base.kpatch").write_text("*.mlp: SwiGLU -> fused_swiglu\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "top.kpatch").write_text('include "base.kpatch"\n')
    e = _run(lambda: load_spec(mine / "top.kpatch"))
    _assert_located(e, 1, 9, "not found", "without include_dirs")
    spec = load_spec(mine / "top.kpatch", include_dirs=[shared])
    assert [r.op.name for r in spec.rules] == ["fused_swiglu"]
    (mine / "top.kpatch").write_text('include "../shared/base.kpatch"\n')
    assert _run(lambda: load_spec(mine / "top.kpatch")) is not None
    assert load_spec(mine / "top.kpatch", include_dirs=[shared]).rules


def test_corpus_cases_fail_quickly_in_a_real_process(tmp_path):
    """The CLI on a hostile spec: exit 2, every error, no traceback (one process for the lot)."""
    import subprocess

    p = subprocess.run([sys.executable, "-m", "patchdsl.cli", "check", str(CORPUS / "include_shadow.kpatch")],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert "include_shadow.kpatch:2:9: error:" in p.stderr
