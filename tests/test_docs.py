"""docs/ops.md is generated from the registry and must be current; every op is documented."""

from pathlib import Path

from patchdsl_tools.docgen import render_ops_md
from patchdsl.ops.registry import OP_MODULES, ops

ROOT = Path(__file__).resolve().parents[1]


def test_ops_md_is_current():
    assert (ROOT / "docs" / "ops.md").read_text() == render_ops_md(), "run: python -m patchdsl_tools.docgen > docs/ops.md"


def test_every_op_module_registers_an_op_with_a_template():
    modules = {type(op).__module__.rsplit(".", 1)[-1] for op in ops().values()}
    assert modules == set(OP_MODULES)
    for op in ops().values():
        if op.external:        # a family of external ops (hub, liger.*) loads its kernels
            assert op.template == "" and op.name.split(".")[0] in ("hub", "liger"), op.name
            continue
        assert (ROOT / "templates" / op.template).is_file(), op.template
        assert op.doc and op.kinds
        for f in op.flags:
            assert f.doc, (op.name, f.name)


def test_language_doc_mentions_every_op_and_kind():
    text = (ROOT / "docs" / "language.md").read_text()
    from patchdsl.model.kinds import KIND_NAMES

    for k in KIND_NAMES:
        assert f"`{k}`" in text, k


def test_op_order_does_not_depend_on_import_order():
    """Importing an op module early (as a test importing one of its constants does) must not
    reorder the registry, or docs/ops.md would depend on which test ran first in a worker."""
    import subprocess
    import sys

    code = ("import patchdsl.ops.linear_cross_entropy, patchdsl.ops.cross_entropy\n"
            "from patchdsl.ops.registry import ops, OP_MODULES\n"
            "print(','.join(dict.fromkeys(type(o).__module__.rsplit('.', 1)[-1] for o in ops().values())))\n"
            "print(','.join(OP_MODULES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1]


def test_ci_runs_exactly_the_readme_test_command_in_a_fresh_venv():
    """.ci/run: a new virtual environment in a new temporary folder, empty caches, and the README's
    test command verbatim (issue 22: a green CI must show what a new user gets)."""
    import re

    readme = (ROOT / "README.md").read_text()
    tests = readme[readme.index("\nTests:"):]
    command = re.search(r"```\n(.+?)\n```", tests).group(1).strip()
    assert "pytest" in command
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in ci.splitlines() if "python -m pytest" in ln and not ln.lstrip().startswith("#")]
    assert len(lines) == 1 and lines[0].startswith(command + " ||"), (lines, command)
    assert re.search(r'^fresh="\$\(mktemp -d', ci, re.M) and 'python3 -m venv "$fresh/venv"' in ci
    assert 'source "$fresh/venv/bin/activate"' in ci
    for var in ("PATCHDSL_CACHE", "TRITON_CACHE_DIR", "TRITON_HOME", "XDG_CACHE_HOME", "PIP_CACHE_DIR", "HF_HOME"):
        assert re.search(rf'\b{var}="\$fresh/', ci), var
