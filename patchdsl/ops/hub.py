"""hub(...): a kernel layer from a Hugging Face Hub kernel repository, loaded by the ``kernels`` library.

    model.norm: RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", version=1)
    *.input_layernorm: RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", revision="0123abc...")
    *.post_attention_layernorm: RMSNorm -> hub("./vendor/my-norm", "MyRMSNorm")      # a local repository

A Hub id needs a pin: ``version=N`` (the repository's ``vN`` branch, kernels' stable API
version) or ``revision=`` (a branch, tag or commit; a full commit sha is a lock).  A local
repository (a first value starting with ``./``, ``../``, ``/`` or ``~``; relative paths are
relative to the spec file) is pinned by its files: ``plan`` records the sha256 of every file under
the folder (other variants, ``__pycache__`` and ``*.pyc`` included: Python imports bytecode) as
the site's ``sha256`` flag, and every load (plan, apply, verify) hashes the folder again before
importing anything from it (``sha256=`` in a spec locks it the same way).  Loading writes no
bytecode into the folder.  The layout is the Hub's: ``<repo>/build/<variant>/`` holding
``metadata.json`` and the package (``<package>/__init__.py`` with a ``layers`` attribute), where
``<variant>`` is ``torch-universal`` for pure-Python (Triton) kernels.

What the op does is what ``kernels.kernelize`` does to a layer, per instance and through the
patchdsl runtime (so ``undo`` restores it and ``verify`` checks it): the module's ``forward``
becomes the Hub layer class's ``forward`` bound to the module, reading the module's own
weights and attributes.  Nothing is downloaded unless a Hub id is named and the machine is
online; with ``HF_HUB_OFFLINE=1`` the kernel must be in the local Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import json
import inspect
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

from .base import FlagSpec, SIZE_MAX
from ..model.info import ModuleInfo
from .external import ExternalOp, kernels_library, missing_kernels_message
from ..model.kinds import KIND_NAMES
from .registry import register

_LOCAL_PREFIXES = ("./", "../", "/", "~")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[^\s\x00-\x1f\x7f]{1,255}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LAYER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")


def is_local(repo: str) -> bool:
    return repo.startswith(_LOCAL_PREFIXES) or repo in (".", "..")


def repo_digest(root: Path) -> str:
    """sha256 over the relative path and bytes of every file under ``root`` (a local kernel
    repository), sorted.  Nothing is left out: not other build variants, not ``__pycache__`` or
    ``*.pyc`` (Python imports bytecode, so planted bytecode is code), not hidden files; a symbolic
    link is hashed as its target text and, when it leads to a folder, that folder's files too."""
    import os

    root = Path(root)
    h = hashlib.sha256()
    seen: set[str] = set()

    def walk(folder: Path, rel: str) -> None:
        real = os.path.realpath(folder)
        if real in seen:            # a link cycle
            h.update(f"cycle {rel}\0".encode())
            return
        seen.add(real)
        for e in sorted(os.scandir(folder), key=lambda e: e.name):
            name = f"{rel}{e.name}"
            if e.is_symlink():
                h.update(f"link {name} -> {os.readlink(e.path)}\0".encode())
            if e.is_dir(follow_symlinks=True):
                walk(Path(e.path), name + "/")
            elif e.is_file(follow_symlinks=True):
                h.update(f"file {name}\0".encode())
                with open(e.path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
            else:
                h.update(f"other {name}\0".encode())

    walk(root, "")
    return h.hexdigest()


class PinMismatch(RuntimeError):
    """A local repository whose files are not the ones the plan recorded."""


_LOADED: dict[tuple, Any] = {}
_WHERE: dict[tuple, str] = {}         # what each loaded layer came from (variant path + hash, or repo)
_DIGEST: dict[tuple, str] = {}        # a local repository's digest when its layer was loaded


def _kernel_module(params: Mapping[str, Any]) -> tuple[Any, str, str]:
    """(the kernel's Python module, a description of what was loaded, the local repository's digest or "")."""
    kernels = kernels_library()
    repo = params["repo"]
    if params["local"]:
        path = Path(repo)
        if not path.is_dir():
            raise FileNotFoundError(f"no folder {path}")
        before = check_pin(params)
        old = sys.dont_write_bytecode
        sys.dont_write_bytecode = True      # loading writes no bytecode into the repository: its digest stays its files'
        try:
            mod = kernels.get_local_kernel(path)
        finally:
            sys.dont_write_bytecode = old
        if repo_digest(path) != before:
            raise PinMismatch(f"the files of {path} changed while it was loaded; load it again")
        try:        # the build variant that loaded (kernels' resolver; not part of its stable API)
            from kernels.resolver import resolve_local_kernel

            where = resolve_local_kernel(path, backend=None).variant_path
        except Exception:
            where = path
        return mod, f"{where} (sha256 {before[:16]})", before
    kw = {"version": params["version"], "revision": params["revision"]}
    if params["trust_remote_code"]:
        if "trust_remote_code" not in inspect.signature(kernels.get_kernel).parameters:
            raise ImportError(f"kernels {getattr(kernels, '__version__', '?')} has no trust_remote_code; "
                              f"upgrade: pip install -U 'patchdsl[hub]'")
        kw["trust_remote_code"] = True
    mod = kernels.get_kernel(repo, **kw)
    commit = None
    try:        # the commit the pin resolved to, as the kernels library recorded it
        for lk in kernels.get_loaded_kernels():
            if lk.module is mod and lk.repo_info is not None:
                commit = lk.repo_info.revision
    except Exception:
        pass
    return mod, f"{repo}@{commit}" if commit else repo, ""


def hub_call(params: Mapping[str, Any], **change: Any) -> str:
    """The spec's ``hub(...)`` call for ``params`` (with ``change`` applied), as a user writes it."""
    p = {**params, **change}
    parts = [f'"{p["repo"]}"', f'"{p["layer"]}"']
    for k in ("version", "revision"):
        if p.get(k) is not None:
            parts.append(f"{k}={p[k]}" if isinstance(p[k], int) else f'{k}="{p[k]}"')
    if p.get("trust_remote_code"):
        parts.append("trust_remote_code=true")
    if p.get("sha256"):
        parts.append(f'sha256="{p["sha256"]}"')
    return f"hub({', '.join(parts)})"


def check_pin(params: Mapping[str, Any]) -> str:
    """The digest of a local repository's files now; PinMismatch when ``params`` pin other files."""
    digest = repo_digest(Path(params["repo"]))
    pin = params.get("sha256")
    if pin and digest != pin:
        raise PinMismatch(f"the files of {params['repo']} are not the ones the plan recorded (sha256 {digest[:16]}, "
                          f"the plan's {pin[:16]}): review them and plan again")
    return digest


def _key(params: Mapping[str, Any]) -> tuple:
    return (params["repo"], params["layer"], params["version"], params["revision"], params["local"],
            params.get("sha256"))


def load_layer(params: Mapping[str, Any]) -> Any:
    """The layer class named by ``params`` (cached per repository, pin and layer).  A local
    repository pinned by ``sha256`` is hashed again on every call, cached or not: files that
    changed since they were pinned are a :class:`PinMismatch`, never imported."""
    key = _key(params)
    got = _LOADED.get(key)
    if got is not None:
        if params["local"]:
            check_pin(params)
        return got
    mod, where, digest = _kernel_module(params)
    layers = getattr(mod, "layers", None)
    if layers is None:
        raise LookupError(f"the kernel at {where} defines no `layers` module")
    got = getattr(layers, params["layer"], None)
    if got is None:
        names = sorted(n for n, v in vars(layers).items() if isinstance(v, type) and not n.startswith("_"))
        raise LookupError(f"the kernel at {where} has no layer {params['layer']!r} "
                          f"(its layers: {', '.join(names) or 'none'})")
    _LOADED[key] = got
    _WHERE[key] = where
    _DIGEST[key] = digest
    return got


def download_command(params: Mapping[str, Any]) -> str:
    """The shell command that puts a Hub kernel into the local cache, every value quoted: the repo
    and pin are Python string literals (JSON strings are), the code one shell-quoted word."""
    pin = (f"version={int(params['version'])}" if params["version"] is not None
           else f"revision={json.dumps(params['revision'])}")
    code = f"from kernels import get_kernel; get_kernel({json.dumps(params['repo'])}, {pin})"
    return "python -c " + shlex.quote(code)


def _hf_offline() -> bool:
    v = os.environ.get("HF_HUB_OFFLINE", "")
    return v.upper() in ("1", "ON", "YES", "TRUE")


class HubLayer(ExternalOp):
    name = "hub"
    kinds = KIND_NAMES
    any_kind = True
    template = ""
    positional = ("repo", "layer")
    doc = ("A kernel layer from a Hugging Face Hub kernel repository (or a local copy), loaded with the "
           "`kernels` library (`pip install 'patchdsl[hub]'`) and bound as the module's forward, per instance. "
           "Write `hub(\"org/repo\", \"Layer\", version=N)` or `revision=\"...\"`, or `hub(\"./folder\", \"Layer\")`.")
    flags = (
        FlagSpec("repo", "str", "", "Hub repository id (org/name), or a local kernel repository folder "
                 "(./path, ../path, /abs/path; relative to the spec file)"),
        FlagSpec("layer", "str", "", "layer class in the repository's `layers` module (e.g. LigerRMSNorm)"),
        FlagSpec("version", "int", None, "kernel API version (the repository's vN branch); "
                 "a Hub id needs version or revision", none_ok=True, min=0, max=SIZE_MAX),
        FlagSpec("revision", "str", None, "branch, tag or commit sha (a full sha locks the kernel)", none_ok=True),
        FlagSpec("trust_remote_code", "bool", False,
                 "allow a repository whose publisher the Hub does not mark as trusted (online only)"),
        FlagSpec("sha256", "str", None, "a local repository only: the sha256 of its files (`plan` records it; "
                 "give it to lock the folder's content)", none_ok=True),
    )

    def locate(self, name: str, value: Any, file: str) -> Any:
        if name != "repo" or not isinstance(value, str) or not is_local(value):
            return value
        p = Path(value).expanduser()
        if not p.is_absolute():
            base = Path(file).parent if file and not file.startswith("<") else Path.cwd()
            p = base / p
        return str(p.resolve())

    def validate(self, flags: Mapping[str, Any]) -> str | None:
        repo, layer = flags.get("repo") or "", flags.get("layer") or ""
        if not repo or not layer:
            return 'hub needs a repository and a layer: hub("org/repo", "Layer", version=1)'
        if not _LAYER.fullmatch(layer):
            return f"the layer must be a class name, got {layer!r:.60}"
        version, revision, sha = flags.get("version"), flags.get("revision"), flags.get("sha256")
        if is_local(repo):
            if version is not None or revision is not None:
                return f"{repo} is a local folder: its files are the pin; drop version= / revision="
            if sha is not None and not _SHA256.fullmatch(sha):
                return f"sha256= must be 64 lowercase hex digits, got {sha!r:.80}"
            return None
        if not _HUB_ID.fullmatch(repo):
            return f"{repo!r:.120} is not a Hub repository id (org/name) nor a local path (./..., /...)"
        if sha is not None:
            return f"sha256= pins a local folder; a Hub id ({repo}) is pinned by version= or revision="
        if version is None and revision is None:
            return (f"hub({repo!r}, {layer!r}) needs a pin: version=N (the kernel's vN branch) or "
                    f"revision=\"<branch, tag or commit>\"")
        if version is not None and revision is not None:
            return "give version= or revision=, not both"
        if revision is not None and not _REVISION.fullmatch(revision):
            return f"revision= must be a branch, tag or commit (no spaces or control characters), got {revision!r:.80}"
        return None

    def unlocked(self, flags: Mapping[str, Any]) -> str | None:
        repo = flags.get("repo") or ""
        if not is_local(repo):
            return None         # validate: a Hub id has its version= or revision=
        if not Path(repo).is_absolute():
            return f"the local repository {repo!r:.120} must be an absolute path in a plan file (plan records it so)"
        if flags.get("sha256") is None:
            return (f"the local repository {repo} has no sha256 pin: a plan file must carry the digest of the files "
                    f"`plan` checked (plan again)")
        return None

    def lock(self, params: Mapping[str, Any]) -> dict[str, Any]:
        if not params["local"] or params.get("sha256"):
            return {}
        digest = _DIGEST.get(_key(params)) or check_pin(params)
        return {"sha256": digest}

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        repo = flags["repo"]
        return {"dtype": dtype, "repo": repo, "layer": flags["layer"], "version": flags.get("version"),
                "revision": flags.get("revision"), "local": is_local(repo),
                "trust_remote_code": bool(flags.get("trust_remote_code", False)), "sha256": flags.get("sha256"),
                "target": target}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return f"hub_{params['layer']}_{params['dtype']}"

    def source(self, params: Mapping[str, Any]) -> str:
        if params["local"]:
            sha = params.get("sha256")
            return f"local {params['repo']} layer {params['layer']}" + (f" (sha256 {sha[:16]})" if sha else "")
        pin = f"version {params['version']}" if params["version"] is not None else f"revision {params['revision']}"
        return f"hub {params['repo']} layer {params['layer']} ({pin})"

    def resolved_source(self, params: Mapping[str, Any]) -> str:
        where = _WHERE.get(_key(params))
        if params["local"] or not where or "@" not in where:
            return self.source(params)
        return f"{self.source(params)} -> {where.split('@', 1)[1]}"

    def unavailable(self, params: Mapping[str, Any]) -> str | None:
        try:
            kernels_library()
        except ImportError:
            return missing_kernels_message()
        try:
            load_layer(params)
        except PinMismatch as e:
            return str(e)
        except Exception as e:      # the kernels library's own words, plus where to put the files
            said = " ".join(str(e).split())
            if "trust_remote_code" in said and not params["local"] and not params["trust_remote_code"]:
                said = said.split(" Set trust_remote_code", 1)[0].rstrip(". ")
                return (f"cannot load {params['repo']}:{params['layer']} ({said}); after reading the repository's "
                        f"code, say in the spec that you trust it: {hub_call(params, trust_remote_code=True)}")
            if params["local"]:
                return (f"cannot load layer {params['layer']!r} from the local repository {params['repo']} ({said}); "
                        f"lay it out as <repo>/build/torch-universal/metadata.json and "
                        f"<repo>/build/torch-universal/<package>/__init__.py defining `layers`")
            how = (f"it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it while online "
                   f"({download_command(params)}), or copy the repository into a folder "
                   f"and write hub(\"./folder\", \"{params['layer']}\")") if _hf_offline() else (
                   "check the repository id, the pin and the network; to work offline copy the repository "
                   f"into a folder and write hub(\"./folder\", \"{params['layer']}\")")
            return f"cannot load {params['repo']}:{params['layer']} ({said}); {how}"
        if not getattr(load_layer(params), "has_backward", True):
            return f"the layer {params['layer']} declares has_backward=False: it cannot be trained through"
        return None

    def load(self, params: Mapping[str, Any]) -> Any:
        return load_layer(params)

    # ---- runtime ----------------------------------------------------------------
    def check(self, module: Any, info: ModuleInfo, flags: Mapping[str, Any]) -> str | None:
        import torch

        params = self.key_params(info, flags, "any", "any")
        try:
            layer = load_layer(params)
        except Exception as e:
            return f"cannot load {self.source(params)}: {e}"
        if not (isinstance(layer, type) and issubclass(layer, torch.nn.Module)):
            return f"{params['layer']} is not a torch.nn.Module class"
        if layer.__init__ is not torch.nn.Module.__init__:
            return f"{params['layer']} has its own __init__ (a kernel layer must be stateless and use the module's weights)"
        if not getattr(layer, "has_backward", True):
            return f"{params['layer']} declares has_backward=False; it cannot be used for training"
        mine = list(inspect.signature(layer.forward).parameters.values())
        theirs = list(inspect.signature(type(module).forward).parameters.values())
        if len(mine) != len(theirs) or any(a.kind != b.kind for a, b in zip(mine, theirs)):
            return (f"{params['layer']}.forward{inspect.signature(layer.forward)} does not match "
                    f"{type(module).__name__}.forward{inspect.signature(type(module).forward)}")
        return None

    def install(self, host: Any, kernels: Any, flags: Mapping[str, Any], info: ModuleInfo) -> list:
        import types

        layer = load_layer(self.key_params(info, flags, "any", "any"))
        # what kernels.kernelize does to a layer, recorded by the runtime so undo restores it
        return [(host, "forward", types.MethodType(layer.forward, host))]


register(HubLayer())


def write_kernel_repo(root: str | Path, name: str, layers_source: str, *, version: int = 1,
                      backend: str = "cpu") -> Path:
    """Lay out a local kernel repository the way the Hub does (for tests and vendoring)::

        <root>/build/torch-universal/metadata.json
        <root>/build/torch-universal/<package>/__init__.py    (from . import layers)
        <root>/build/torch-universal/<package>/layers.py      (layers_source)

    ``name`` is the kernel's name (lowercase letters, digits, dashes); the package is its
    underscore form.  The ``kernels`` library identifies a loaded kernel by the metadata ``id``,
    which is derived here from the name and a hash of ``layers_source`` so two repositories
    with different code never share a module.  Returns ``root``.
    """
    import json

    from ..util import files

    root = Path(root)
    pkg = name.replace("-", "_")
    variant = root / "build" / "torch-universal"
    files.check_folder(variant / pkg, what="kernel package folder")
    digest = hashlib.sha256(layers_source.encode()).hexdigest()[:12]
    files.write_text(variant / "metadata.json", json.dumps({
        "id": f"{pkg}_{digest}", "name": name, "version": version, "license": "apache-2.0",
        "python-depends": [], "backend": {"type": backend}}, indent=2), what="kernel metadata")
    files.write_text(variant / pkg / "__init__.py", "from . import layers\n", what="kernel package")
    files.write_text(variant / pkg / "layers.py", layers_source, what="kernel layers")
    return root
