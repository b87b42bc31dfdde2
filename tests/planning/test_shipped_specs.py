"""Every shipped spec passes `verify` on a tiny model of its family, in fp32 and bf16 (CPU)."""

import pytest

from patchdsl.parity import verify
from patchdsl.util.resources import shipped_spec
from patchdsl.syntax import load_spec

from ..families import FAMILIES, tiny_model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_shipped_spec_verifies(family, dtype):
    spec = load_spec(shipped_spec(family))
    report = verify(spec, lambda: tiny_model(family), dtype=dtype, batch=2, seq=8, seed=0, device="cpu")
    failed = [r for r in report.rows if not r.passed]
    assert report.passed, [(r.path, r.op, r.quantity, r.rel_fro_err, r.tolerance) for r in failed][:8]
    j = report.to_json()
    ops = {s["op"] for s in j["sites"]}
    # every rule of the spec produced at least one checked site, and nothing was refused
    assert ops == {r.op.name for r in spec.rules}, ops
    assert not j.get("refused"), j.get("refused")
