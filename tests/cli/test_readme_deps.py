"""The README's install gives everything the README's examples need (issue 38): every module its
Python blocks and ``examples/`` import, and what transformers' Trainer needs at run time (accelerate),
comes from the dependencies ``pyproject.toml`` declares -- checked in a subprocess where every
installed distribution outside those dependencies (and what they require) cannot be imported.
No network: the installed distributions' metadata gives the closure of the declared dependencies.
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def declared_closure() -> set[str]:
    """The distributions a plain ``pip install -e .`` brings: the declared dependencies (no extras) and,
    through the installed metadata, everything they require (markers evaluated here, no extras)."""
    import tomllib            # Python 3.11+ (the suite runs on 3.11 and later; patchdsl itself takes 3.10)

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(d) for d in deps]
    seen: set[str] = {"patchdsl"}
    while todo:
        r = todo.pop()
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(r.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(x) for x in (md.requires(name) or [])]
        except md.PackageNotFoundError:      # required but not installed here (a platform's own build)
            pass
    return seen


def example_sources() -> dict[str, str]:
    """The README's Python blocks and the example scripts."""
    readme = (ROOT / "README.md").read_text()
    out = {f"README.md python block {i + 1}": b for i, b in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S))}
    out.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))})
    return out


def imports_of(source: str) -> list[str]:
    """The import statements of ``source`` (at any depth), and for a fragment's names that nothing in it
    defines and transformers exports (the README's ``Trainer``, ``HfArgumentParser``) the import of them."""
    tree = ast.parse(source)
    lines, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            lines += [f"import {a.name}" for a in node.names]
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            lines.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    free = sorted(n for n in used - bound if n[:1].isupper() and n not in dir(builtins))
    if free:
        import transformers

        lines += [f"from transformers import {n}" for n in free if hasattr(transformers, n)]
    return lines


# In the subprocess: distributions outside the closure are not installed, as far as Python can tell (not
# importable, not found, no metadata), then the examples' imports run and a Trainer is built -- where
# transformers asks for accelerate.
CHILD = r"""
import importlib.abc, importlib.metadata as md, importlib.util, json, sys, tempfile
allowed, lines = json.loads(sys.argv[1]), json.loads(sys.argv[2])
from packaging.utils import canonicalize_name
owners = md.packages_distributions()
blocked_dists = {canonicalize_name(d.metadata["Name"]) for d in md.distributions()} - set(allowed)
blocked_mods = {m for m, ds in owners.items() if ds and all(canonicalize_name(d) in blocked_dists for d in ds)}
def blocked(name):
    return str(name).split(".")[0] in blocked_mods or canonicalize_name(str(name)) in blocked_dists
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r} (not a declared dependency)", name=name)
sys.meta_path.insert(0, Block())
_find, _version, _dist = importlib.util.find_spec, md.version, md.distribution
importlib.util.find_spec = lambda name, package=None: None if blocked(name) else _find(name, package)
def version(name):
    if blocked(name):
        raise md.PackageNotFoundError(name)
    return _version(name)
def distribution(name):
    if blocked(name):
        raise md.PackageNotFoundError(name)
    return _dist(name)
md.version, md.distribution = version, distribution
for line in lines:
    exec(line, {})
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
import patchdsl
cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=64)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, report_to="none", use_cpu=True)
    Trainer(model=LlamaForCausalLM(cfg), args=args, callbacks=[patchdsl.PatchdslCallback.from_args(patchdsl.PatchdslArguments(kpatch_spec="qwen3"))])
print("ok", len(lines))
"""


def test_the_readme_install_gives_what_the_readme_examples_import_and_run():
    import json

    sources = example_sources()
    assert any(k.startswith("README") for k in sources) and "examples/train_sft.py" in sources, list(sources)
    lines = sorted({ln for src in sources.values() for ln in imports_of(src)})
    # what the README's training snippet uses without importing it resolves to transformers' names
    assert {"from transformers import Trainer", "from transformers import HfArgumentParser", "import yaml",
            "import patchdsl"} <= set(lines), lines
    closure = declared_closure()
    assert "accelerate" in closure, "the Trainer of the README's training example needs accelerate>=1.1"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(sorted(closure)), json.dumps(lines)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout[-2000:] + p.stderr[-3000:]


def test_the_closure_is_what_pip_would_install():
    """The closure test above can fail: a distribution only an extra brings is outside it."""
    closure = declared_closure()
    assert {"torch", "transformers", "click", "huggingface-hub", "accelerate", "psutil"} <= closure
    assert not closure & {"pytest", "hypothesis", "peft", "trl", "deepspeed", "kernels", "liger-kernel", "matplotlib"}
