"""docs/ops.md is generated from the registry and must be current; every op is documented."""

from pathlib import Path

from patchdsl.docgen import render_ops_md
from patchdsl.ops.registry import OP_MODULES, ops

ROOT = Path(__file__).resolve().parents[1]


def test_ops_md_is_current():
    assert (ROOT / "docs" / "ops.md").read_text() == render_ops_md(), "run: python -m patchdsl.docgen > docs/ops.md"


def test_every_op_module_registers_an_op_with_a_template():
    names = set(ops())
    assert len(names) == len(OP_MODULES)
    for op in ops().values():
        assert (ROOT / "templates" / op.template).is_file(), op.template
        assert op.doc and op.kinds
        for f in op.flags:
            assert f.doc, (op.name, f.name)


def test_language_doc_mentions_every_op_and_kind():
    text = (ROOT / "docs" / "language.md").read_text()
    from patchdsl.ops.registry import KIND_NAMES

    for k in KIND_NAMES:
        assert f"`{k}`" in text, k
