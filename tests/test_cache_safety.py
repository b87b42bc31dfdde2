"""Data never becomes code, and the kernel cache imports only what this version rendered.

Hostile values at the codegen boundary (non-finite numbers, free text, path traversal in a
kernel name) raise CodegenError; the cache refuses unsafe folders, regenerates files that fail
their sha256 check, falls back to a private temporary folder when it cannot write, and never lets
a raw OSError through.
"""

import errno
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
from patchdsl.ops.base import ModuleInfo
from patchdsl.ops.registry import get_op
from patchdsl.resources import templates_dir


def _key(hidden=32, dtype="fp32", **facts):
    op = get_op("fused_rmsnorm")
    f = {"hidden": hidden, "eps": 1e-6, "offset": 0.0, "casting": "llama"}
    f.update(facts)
    info = ModuleInfo("m", "M", (), {"RMSNorm": f}, dtype=dtype)
    p = op.key_params(info, op.default_flags(), dtype, "interpreter")
    return KernelKey.make(op.name, op.template, op.kernel_name(p), p)


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
