"""Data never becomes code, and the kernel cache imports only what this version rendered.

Hostile values at the codegen boundary (non-finite numbers, free text, path traversal in a
kernel name) raise CodegenError; the cache refuses unsafe folders, regenerates files that fail
their sha256 check, falls back to a private temporary folder when it cannot write, and never lets
a raw OSError through.
"""

import errno
import re
import os
import stat
import warnings
from pathlib import Path

import jinja2
import pytest
from jinja2 import nodes

from patchdsl.codegen import KernelKey, cache as cache_mod, render
from patchdsl.codegen.cache import CacheError, CacheWarning, check_text, file_text, load_kernel, write_kernel
from patchdsl.codegen.render import CodegenError, _env, literal
from patchdsl.model.info import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.util.resources import templates_dir


def _key(hidden=32, dtype="fp32", **facts):
    op = get_op("fused_rmsnorm")
    f = {"hidden": hidden, "eps": 1e-6, "offset": 0.0, "casting": "llama"}
    f.update(facts)
    info = ModuleInfo("m", "M", (), {"RMSNorm": f}, dtype=dtype)
    p = op.key_params(info, op.default_flags(), dtype, "interpreter")
    return KernelKey.for_op(op, p)


def _with(key, **changes):
    return KernelKey.make(key.op, key.template, changes.pop("name", key.name), {**key.param_dict, **changes})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    monkeypatch.setenv("PATCHDSL_CACHE", str(root))
    monkeypatch.setattr(cache_mod, "_fallback", None)
    monkeypatch.setattr(cache_mod, "_checked", set())
    cache_mod._loaded.clear()
    yield root
    cache_mod._loaded.clear()


# ------------------------------------------------------------------ the escaping filter
@pytest.mark.parametrize("value, text", [
    (1e-6, "1e-06"), (0.0, "0.0"), (-3, "-3"), (2 ** 40, str(2 ** 40)), (True, "True"), (None, "None"),
    ("bf16", "bf16"), ("h1024", "h1024"),
])
def test_literal_writes_python_literals(value, text):
    assert literal(value) == text


@pytest.mark.parametrize("value", [
    float("inf"), float("-inf"), float("nan"), 2 ** 63, "a\nb", "x'); __import__('os').system('id'); ('",
    "../../etc", "", "1abc", [1], {"a": 1}, b"bytes", 1 + 2j,
])
def test_literal_rejects_what_is_not_a_safe_literal(value):
    with pytest.raises(CodegenError):
        literal(value)


@pytest.mark.parametrize("change", [
    {"eps": float("inf")}, {"eps": float("nan")}, {"offset": float("-inf")},
    {"casting": "llama\nimport os"}, {"casting": "__import__('os')"}, {"dtype": "float64"},
    {"target": "cpu"}, {"tag": "h32\nimport os"}, {"tag": "h32 + 1"}, {"eps": "1e-6"}, {"hidden": [32]},
    {"name": "../../outside"}, {"name": "k\nimport os"}, {"name": ""},
])
def test_render_rejects_hostile_parameters(change):
    with pytest.raises(CodegenError):
        render(_with(_key(), **change))


def test_render_rejects_a_template_that_is_not_the_ops():
    k = _key()
    with pytest.raises(CodegenError):
        render(KernelKey.make(k.op, "../../etc/passwd", k.name, k.param_dict))
    with pytest.raises(CodegenError):
        render(KernelKey.make(k.op, "fused_glu.py.j2", k.name, k.param_dict))
    with pytest.raises(CodegenError):
        render(KernelKey.make("no_such_op", k.template, k.name, k.param_dict))


def _template_locals(ast) -> set:
    out = set()
    for n in ast.find_all((nodes.Assign, nodes.AssignBlock, nodes.For, nodes.Macro, nodes.CallBlock)):
        if isinstance(n, (nodes.Macro, nodes.CallBlock)):
            out |= {a.name for a in n.args}
        else:
            out |= {x.name for x in n.target.find_all(nodes.Name)}
            if isinstance(n.target, nodes.Name):
                out.add(n.target.name)
    return out | {"c", "ce", "caller", "loop"}


@pytest.mark.parametrize("template", sorted(p.name for p in templates_dir().glob("*.j2")))
def test_templates_emit_parameters_only_through_lit(template):
    """Every ``{{ name }}`` that writes a parameter (a name the template did not set itself) goes
    through ``| lit``; computed expressions go through the environment's finalize (literal())."""
    env = _env()
    assert env.finalize is not None and "pyrepr" not in env.filters
    ast = env.parse((templates_dir() / template).read_text())
    local = _template_locals(ast)
    bare = [f"line {item.lineno}: {{{{ {item.name} }}}}" for out in ast.find_all(nodes.Output) for item in out.nodes
            if isinstance(item, nodes.Name) and item.name not in local]
    assert not bare, bare


def test_header_has_no_unescaped_value():
    text = render(_key())
    head = text.splitlines()[:4]
    assert all(line.startswith("# ") for line in head)
    with pytest.raises(CodegenError):
        render(_with(_key(), name="x\n__import__('os').system('id')"))


# ------------------------------------------------------------------ cache folder
def test_cache_folder_is_created_private(cache):
    path = write_kernel(_key())
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert path.read_text() == file_text(_key()) and check_text(path.read_text()) is None


def test_cache_folder_writable_by_others_is_refused(cache):
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    with pytest.raises(CacheError, match="writable by group or others"):
        load_kernel(_key())
    assert not any(cache.rglob("*.py"))


def test_cache_folder_of_another_user_is_refused(cache, monkeypatch):
    cache.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(cache).st_uid + 1)
    with pytest.raises(CacheError, match="owned by uid"):
        load_kernel(_key())


@pytest.mark.parametrize("damage", ["truncated", "empty", "planted", "planted_with_hash", "no_hash_line"])
def test_a_damaged_or_planted_file_is_regenerated_before_import(cache, damage, tmp_path):
    k = _key()
    path = write_kernel(k)
    good = path.read_text()
    marker = tmp_path / "pwned"
    evil = f"open({str(marker)!r}, 'w').write('x')\n"
    import hashlib
    text = {
        "truncated": good[: len(good) // 2],
        "empty": "",
        "planted": good.splitlines(True)[0] + evil,
        "planted_with_hash": f"{cache_mod.SHA_PREFIX}{hashlib.sha256(evil.encode()).hexdigest()}\n{evil}",
        "no_hash_line": render(k),
    }[damage]
    path.write_text(text)
    with pytest.warns(CacheWarning, match="failed its check"):
        mod = load_kernel(k)
    assert not marker.exists()
    assert path.read_text() == good and hasattr(mod, "rmsnorm")


def test_read_only_cache_falls_back_to_a_private_temporary_folder(cache, monkeypatch):
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        if self == cache or cache in self.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.warns(CacheWarning, match="Read-only file system"):
        mod = load_kernel(_key())
    fb = cache_mod._fallback
    assert fb is not None and Path(mod.__file__).is_relative_to(fb)
    assert stat.S_IMODE(os.stat(fb).st_mode) == 0o700


def test_full_disk_falls_back_and_a_second_failure_is_a_clear_error(cache, monkeypatch):
    real = cache_mod.atomic_write
    calls = []

    def full(path, text):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, text)

    monkeypatch.setattr(cache_mod, "atomic_write", full)
    with pytest.warns(CacheWarning, match="No space left"):
        path = write_kernel(_key())
    assert path.is_relative_to(cache_mod._fallback)

    def always_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cache_mod, "atomic_write", always_full)
    with pytest.raises(CacheError, match="No space left"):
        write_kernel(_key(hidden=48))


def test_kernel_paths_never_leave_the_cache(cache):
    with pytest.raises(CodegenError):
        write_kernel(_with(_key(), name="../../../tmp/evil"))
    with pytest.raises(CodegenError):
        write_kernel(_with(_key(), name="..%2f"), cache.parent, flat=True)
    assert not (cache.parent.parent / "tmp").exists()


# ------------------------------------------------------------------ codegen --out
def test_codegen_out_gives_different_kernels_different_names_and_never_overwrites(tmp_path):
    a, b = _key(eps=1e-6), _key(eps=1e-5)
    assert a.name == b.name                         # the readable name does not show eps ...
    pa, pb = write_kernel(a, tmp_path, flat=True), write_kernel(b, tmp_path, flat=True)
    assert pa != pb                                 # ... the short hash does
    assert "EPS = tl.constexpr(1e-06)" in pa.read_text() and "EPS = tl.constexpr(1e-05)" in pb.read_text()
    assert write_kernel(a, tmp_path, flat=True) == pa          # same kernel again: unchanged
    pa.write_text("# edited by hand\n")
    with pytest.raises(CacheError, match="not overwriting"):
        write_kernel(a, tmp_path, flat=True)
    assert pa.read_text() == "# edited by hand\n"


# ------------------------------------------------------------------ what is imported is what was checked
OTHER_UID = 4242


def _same_inode(st, ident):
    return (st.st_dev, st.st_ino) == ident


def _as_other_owner(monkeypatch, path):
    """Make ``path`` owned by another user: really (os.chown) when running as root, else by
    reporting another uid for its inode from os.stat / os.fstat."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, -1, follow_symlinks=False)
        return
    st0 = os.stat(path, follow_symlinks=False)
    ident = (st0.st_dev, st0.st_ino)

    def other(st):
        if not _same_inode(st, ident):
            return st
        f = list(st)
        f[stat.ST_UID] = OTHER_UID
        return os.stat_result(f)

    real_stat, real_fstat = os.stat, os.fstat
    monkeypatch.setattr(os, "stat", lambda p, *a, **kw: other(real_stat(p, *a, **kw)))
    monkeypatch.setattr(os, "fstat", lambda fd: other(real_fstat(fd)))


def _evil(marker):
    return f"open({str(marker)!r}, 'w').write('x')\n"


def _plant_pyc(path, marker, monkeypatch):
    """A __pycache__ entry for ``path`` whose header (mtime, size) matches the .py: the import
    system would run it instead of the source."""
    import importlib.util
    import marshal
    code = compile(_evil(marker), str(path), "exec")
    st = os.stat(path)
    pyc = Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
                    + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                    + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(code))


def _plant_symlink_to_copy(path, marker, monkeypatch):
    outside = path.parents[2] / "outside_copy.py"           # same text, outside the cache
    outside.write_text(path.read_text())
    path.unlink()
    path.symlink_to(outside)


def _plant_symlink_to_evil(path, marker, monkeypatch):
    import hashlib
    evil = _evil(marker)
    outside = path.parents[2] / "outside_evil.py"
    outside.write_text(f"{cache_mod.SHA_PREFIX}{hashlib.sha256(evil.encode()).hexdigest()}\n{evil}")
    path.unlink()
    path.symlink_to(outside)


def _plant_fifo(path, marker, monkeypatch):
    path.unlink()
    os.mkfifo(path)


# (row, plant, what load_kernel must do: None = load silently, else a CacheWarning matching this,
#  after which the file is regenerated).  In every row the marker must not exist afterwards and
#  the module must be the rendered one.
FILE_PLANTS = [
    ("pyc_with_matching_header", _plant_pyc, None),
    ("other_owner", lambda p, m, mp: _as_other_owner(mp, p), "owned by uid 4242, not by you"),
    ("mode_0666", lambda p, m, mp: os.chmod(p, 0o666), r"writable by group or others \(mode 0666\)"),
    ("mode_0620_group_writable", lambda p, m, mp: os.chmod(p, 0o620), r"writable by group or others \(mode 0620\)"),
    ("symlink_to_a_good_copy", _plant_symlink_to_copy, "is a symbolic link"),
    ("symlink_to_planted_code", _plant_symlink_to_evil, "is a symbolic link"),
    ("fifo", _plant_fifo, "not a regular file"),
    ("good_text_then_more", lambda p, m, mp: p.write_text(p.read_text() + _evil(m)), "longer than what this version renders"),
    ("latin1_bytes", lambda p, m, mp: p.write_bytes(p.read_bytes()[:-1] + b"\xe9"), "not UTF-8 text"),
]


@pytest.mark.parametrize("row, plant, warning", FILE_PLANTS, ids=[r[0] for r in FILE_PLANTS])
def test_planted_kernel_files_never_run(cache, tmp_path, monkeypatch, row, plant, warning):
    k = _key(hidden=40)
    path = write_kernel(k)
    good = path.read_text()
    marker = tmp_path / "pwned"
    plant(path, marker, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = load_kernel(k)
    monkeypatch.undo()                                  # the real os.stat again (non-root runs)
    msgs = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert not marker.exists(), "planted code ran"
    assert hasattr(mod, "rmsnorm") and mod.HIDDEN_SIZE == 40
    if warning is None:
        assert not msgs
    else:
        assert len(msgs) == 1 and re.search(warning, msgs[0]) and "replaced by a freshly generated file" in msgs[0]
        st = os.stat(path, follow_symlinks=False)       # regenerated: a private regular file of ours
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
        assert path.read_text() == good
    for outside in tmp_path.glob("outside_*.py"):      # a link's target is never written
        assert "pwned" in outside.read_text() or outside.read_text() == good


def test_no_bytecode_is_read_or_written_for_cache_kernels(cache, monkeypatch):
    monkeypatch.setattr("sys.dont_write_bytecode", False)
    mod = load_kernel(_key(hidden=24))
    assert not list(cache.rglob("__pycache__")) and not list(cache.rglob("*.pyc"))
    assert mod.__spec__.cached is None and getattr(mod, "__cached__", None) is None


def test_triton_runs_the_checked_text_even_if_the_file_changes_after_loading(cache):
    """Triton reads a kernel's source through linecache (at decoration on a GPU, at the first call
    under the interpreter): it must get the text that was checked, not whatever the disk holds."""
    import linecache

    import torch
    k = _key(hidden=32)
    path = write_kernel(k)
    mod = load_kernel(k)
    edited = path.read_text().replace("y = xn * w[None, :]", "y = xn * w[None, :] * 2.0")
    assert edited != path.read_text()
    path.write_text(edited)
    linecache.clearcache()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(32, generator=g)
    y, _ = mod.rmsnorm_forward(x, w)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


# (row, how the folders are set up under tmp_path, expected: None = loads, else CacheError match)
FOLDER_PLANTS = [
    ("cache_folder_0777", lambda t, mp: _mk(t / "kernels", 0o777), r"kernels is writable by group or others \(mode 0777\)"),
    ("cache_folder_0770_group", lambda t, mp: _mk(t / "kernels", 0o770), r"writable by group or others \(mode 0770\)"),
    ("hash_subfolder_0777", None, r"writable by group or others \(mode 0777\)"),
    ("parent_0777_no_sticky", lambda t, mp: _mk(t / "shared", 0o777), r"shared, a parent of the kernel cache folder .* "
                                                                    r"writable by others without the sticky bit \(mode 0777\)"),
    ("grandparent_0757_no_sticky", lambda t, mp: _mk(t, 0o757), r"writable by others without the sticky bit \(mode 0757\)"),
    ("parent_1777_sticky", lambda t, mp: _mk(t / "shared", 0o1777), None),
    ("parent_0770_group_writable", lambda t, mp: _mk(t / "shared", 0o770), None),
    ("parent_of_another_owner", lambda t, mp: _as_other_owner(mp, _mk(t / "shared", 0o755)),
     r"shared, a parent of the kernel cache folder .* is owned by uid 4242, neither you"),
]


def _mk(folder, mode):
    folder.mkdir(exist_ok=True)
    os.chmod(folder, mode)
    return folder


@pytest.mark.parametrize("row, setup, error", FOLDER_PLANTS, ids=[r[0] for r in FOLDER_PLANTS])
def test_unsafe_cache_folders_and_parents_are_refused(cache, tmp_path, monkeypatch, row, setup, error):
    base = tmp_path / "base"
    _mk(base, 0o700)
    root = (base if row.startswith("cache_folder") else base / "shared") / "kernels"
    monkeypatch.setenv("PATCHDSL_CACHE", str(root))
    k = _key(hidden=56)
    if setup is None:                                   # the <hash[:2]> folder under a private cache
        sub = write_kernel(k).parent
        sub.joinpath(write_kernel(k).name).unlink()
        os.chmod(sub, 0o777)
        cache_mod._checked.clear()
    else:
        setup(base, monkeypatch)
    try:
        if error is None:
            assert hasattr(load_kernel(k), "rmsnorm")
        else:
            with pytest.raises(CacheError, match=error):
                load_kernel(k)
            assert not any(p.suffix == ".py" for p in base.rglob("*")), "nothing is written into an unsafe cache"
    finally:
        for p in [base, *base.rglob("*")]:             # let pytest clean up
            if p.is_dir() and not p.is_symlink():
                os.chmod(p, 0o700)
