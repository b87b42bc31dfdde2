"""bench/host_breakdown.py on the CPU at tiny shapes: every layer is measured and the derived rows
add up; an unknown op is an error; two runs compare.  (Times are printed, never asserted.)"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("host_breakdown", os.path.join(ROOT, "bench", "host_breakdown.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_layer_is_measured_and_the_derived_rows_add_up(tmp_path, capsys):
    hb = _script()
    out = tmp_path / "hb.json"
    assert hb.main(["--tiny", "--ops", "swiglu", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (rec,) = doc["records"]
    u = rec["us"]
    for k in ("loop", "empty_like", "fn_floor", "entry_nolaunch", "entry", "entry_normal", "bench_call", "hf"):
        assert isinstance(u[k], float) and u[k] > 0, k
    assert u["launch"] == pytest.approx(u["entry"] - u["entry_nolaunch"])
    assert u["wrapper"] == pytest.approx(u["bench_call"] - u["entry"])
    assert rec["kernel"].startswith("fused_swiglu") and doc["patchdsl_from"] == ROOT
    assert "swiglu" in capsys.readouterr().out
    assert "entry before" in hb.compare(doc, doc)


def test_an_unknown_op_is_an_error(capsys):
    hb = _script()
    assert hb.main(["--tiny", "--ops", "no_such_op"]) == 1
    assert "no bench family 'no_such_op'" in capsys.readouterr().out
