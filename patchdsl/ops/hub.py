"""hub(...): a kernel layer from a Hugging Face Hub kernel repository, loaded by the ``kernels`` library.

    model.norm: RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", version=1)
    *.input_layernorm: RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", revision="0123abc...")
    *.post_attention_layernorm: RMSNorm -> hub("./vendor/my-norm", "MyRMSNorm")      # a local repository

A Hub id needs a pin: ``version=N`` (the repository's ``vN`` branch, kernels' stable API
version) or ``revision=`` (a branch, tag or commit; a full commit sha is a lock).  A local
repository (a first value starting with ``./``, ``../``, ``/`` or ``~``; relative paths are
relative to the spec file) is pinned by its files: ``plan`` shows the sha256 of the build
variant that will load.  The layout is the Hub's: ``<repo>/build/<variant>/`` holding
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
import inspect
import os
from pathlib import Path
from typing import Any, Mapping

from .base import FlagSpec, ModuleInfo, Op, SIZE_MAX
from .external import kernels_library, missing_kernels_message
from .registry import KIND_NAMES, register

_LOCAL_PREFIXES = ("./", "../", "/", "~")


def is_local(repo: str) -> bool:
    return repo.startswith(_LOCAL_PREFIXES) or repo in (".", "..")


def variant_digest(path: Path) -> str:
    """sha256 over the relative paths and bytes of every file under ``path`` (sorted; no bytecode)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix != ".pyc"):
        h.update(str(f.relative_to(path)).encode())
        h.update(b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


_LOADED: dict[tuple, Any] = {}
_WHERE: dict[tuple, str] = {}         # what each loaded layer came from (variant path + hash, or repo)


def _kernel_module(params: Mapping[str, Any]) -> tuple[Any, str]:
    """(the kernel's Python module, a description of what was loaded)."""
    kernels = kernels_library()
    repo = params["repo"]
    if params["local"]:
        path = Path(repo)
        if not path.is_dir():
            raise FileNotFoundError(f"no folder {path}")
        mod = kernels.get_local_kernel(path)
        try:        # the build variant that loaded (kernels' resolver; not part of its stable API)
            from kernels.resolver import resolve_local_kernel

            where = resolve_local_kernel(path, backend=None).variant_path
        except Exception:
            where = path
        return mod, f"{where} (sha256 {variant_digest(where)[:16]})"
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
    return mod, f"{repo}@{commit}" if commit else repo


def load_layer(params: Mapping[str, Any]) -> Any:
    """The layer class named by ``params`` (cached per repository, pin and layer)."""
    key = (params["repo"], params["layer"], params["version"], params["revision"], params["local"])
    got = _LOADED.get(key)
    if got is None:
        mod, where = _kernel_module(params)
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
    return got


def _hf_offline() -> bool:
    v = os.environ.get("HF_HUB_OFFLINE", "")
    return v.upper() in ("1", "ON", "YES", "TRUE")


class HubLayer(Op):
    name = "hub"
    kinds = KIND_NAMES
    any_kind = True
    external = True
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
        version, revision = flags.get("version"), flags.get("revision")
        if is_local(repo):
            if version is not None or revision is not None:
                return f"{repo} is a local folder: its files are the pin; drop version= / revision="
            return None
        if repo.count("/") != 1 or not all(repo.split("/")):
            return f"{repo!r} is not a Hub repository id (org/name) nor a local path (./..., /...)"
        if version is None and revision is None:
            return (f"hub({repo!r}, {layer!r}) needs a pin: version=N (the kernel's vN branch) or "
                    f"revision=\"<branch, tag or commit>\"")
        if version is not None and revision is not None:
            return "give version= or revision=, not both"
        return None

    def key_params(self, info: ModuleInfo, flags: Mapping[str, Any], dtype: str, target: str) -> dict[str, Any]:
        repo = flags["repo"]
        return {"dtype": dtype, "repo": repo, "layer": flags["layer"], "version": flags.get("version"),
                "revision": flags.get("revision"), "local": is_local(repo),
                "trust_remote_code": bool(flags.get("trust_remote_code", False)), "target": target}

    def kernel_name(self, params: Mapping[str, Any]) -> str:
        return f"hub_{params['layer']}_{params['dtype']}"

    def source(self, params: Mapping[str, Any]) -> str:
        if params["local"]:
            return f"local {params['repo']} layer {params['layer']}"
        pin = f"version {params['version']}" if params["version"] is not None else f"revision {params['revision']}"
        return f"hub {params['repo']} layer {params['layer']} ({pin})"

    def resolved_source(self, params: Mapping[str, Any]) -> str:
        where = _WHERE.get((params["repo"], params["layer"], params["version"], params["revision"], params["local"]))
        if not where:
            return self.source(params)
        if params["local"]:
            return f"{self.source(params)}, {where}"
        return f"{self.source(params)} -> {where.split('@', 1)[1]}" if "@" in where else self.source(params)

    def unavailable(self, params: Mapping[str, Any]) -> str | None:
        try:
            kernels_library()
        except ImportError:
            return missing_kernels_message()
        try:
            load_layer(params)
        except Exception as e:      # the kernels library's own words, plus where to put the files
            said = " ".join(str(e).split())
            if params["local"]:
                return (f"cannot load layer {params['layer']!r} from the local repository {params['repo']} ({said}); "
                        f"lay it out as <repo>/build/torch-universal/metadata.json and "
                        f"<repo>/build/torch-universal/<package>/__init__.py defining `layers`")
            how = (f"it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it while online "
                   f"(python -c \"from kernels import get_kernel; get_kernel('{params['repo']}', "
                   + (f"version={params['version']}" if params["version"] is not None
                      else f"revision='{params['revision']}'") + ")\"), or copy the repository into a folder "
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

    root = Path(root)
    pkg = name.replace("-", "_")
    variant = root / "build" / "torch-universal"
    (variant / pkg).mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(layers_source.encode()).hexdigest()[:12]
    (variant / "metadata.json").write_text(json.dumps({
        "id": f"{pkg}_{digest}", "name": name, "version": version, "license": "apache-2.0",
        "python-depends": [], "backend": {"type": backend}}, indent=2))
    (variant / pkg / "__init__.py").write_text("from . import layers\n")
    (variant / pkg / "layers.py").write_text(layers_source)
    return root
