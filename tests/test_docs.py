"""docs/ops.md is generated from the registry and must be current; every op is documented."""

from pathlib import Path

from patchdsl.docgen import render_ops_md
from patchdsl.ops.registry import OP_MODULES, ops

ROOT = Path(__file__).resolve().parents[1]


def test_ops_md_is_current():
    assert (ROOT / "docs" / "ops.md").read_text() == render_ops_md(), "run: python -m patchdsl.docgen > docs/ops.md"


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
    from patchdsl.ops.registry import KIND_NAMES

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
