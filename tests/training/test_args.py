"""PatchdslArguments and patchdsl.TrainingArguments through HfArgumentParser: command line, YAML, JSON."""

import json
import subprocess
import sys

import pytest

import patchdsl
from patchdsl import SpecError

SPEC = "specs/qwen3.kpatch"


def _parsers():
    from transformers import HfArgumentParser, TrainingArguments

    return {
        "two dataclasses": (HfArgumentParser((TrainingArguments, patchdsl.PatchdslArguments)), 1),
        "patchdsl.TrainingArguments": (HfArgumentParser((patchdsl.TrainingArguments,)), 0),
    }


KEYS = {"kpatch_spec": SPEC, "kpatch_strict": False, "kpatch_verify": True, "kpatch_dtype": ["bf16", "fp32"],
        "kpatch_log": "sites"}


def _check(ns):
    assert ns.kpatch_spec == SPEC
    assert ns.kpatch_strict is False and ns.kpatch_verify is True and ns.kpatch_from_liger is False
    assert ns.kpatch_dtype == ["bf16", "fp32"] and ns.kpatch_log == "sites"


@pytest.mark.parametrize("which", ["two dataclasses", "patchdsl.TrainingArguments"])
@pytest.mark.parametrize("source", ["command line", "yaml", "json"])
def test_parse_into_both_dataclasses(tmp_path, which, source):
    parser, at = _parsers()[which]
    common = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none"}
    if source == "command line":
        out = parser.parse_args_into_dataclasses(
            ["--output_dir", common["output_dir"], "--use_cpu", "--report_to", "none", "--kpatch_spec", SPEC,
             "--kpatch_strict", "false", "--kpatch_verify", "--kpatch_dtype", "bf16", "fp32", "--kpatch_log", "sites"])
    elif source == "yaml":
        import yaml

        f = tmp_path / "train.yaml"
        f.write_text(yaml.safe_dump({**common, **KEYS}))
        out = parser.parse_yaml_file(str(f))
    else:
        f = tmp_path / "train.json"
        f.write_text(json.dumps({**common, **KEYS}))
        out = parser.parse_json_file(str(f))
    _check(out[at])
    assert out[0].output_dir == common["output_dir"]


def test_defaults_and_no_flag():
    from transformers import HfArgumentParser

    (a,) = HfArgumentParser((patchdsl.PatchdslArguments,)).parse_args_into_dataclasses([])
    assert (a.kpatch_spec, a.kpatch_strict, a.kpatch_verify, a.kpatch_from_liger, a.kpatch_dtype, a.kpatch_log) == \
        (None, True, False, False, None, "totals")
    (a,) = HfArgumentParser((patchdsl.PatchdslArguments,)).parse_args_into_dataclasses(
        ["--kpatch_spec", "qwen3", "--no_kpatch_strict", "--kpatch_from_liger", "false"])
    assert a.kpatch_spec == "qwen3" and a.kpatch_strict is False


@pytest.mark.parametrize("kw,exc,frag", [
    ({"kpatch_spec": "qwen3", "kpatch_from_liger": True}, ValueError, "not both"),
    ({"kpatch_dtype": ["bf16", "fp8"]}, ValueError, "unknown dtype 'fp8'"),
    ({"kpatch_log": "everything"}, ValueError, "kpatch_log must be one of"),
    ({"kpatch_spec": "nosuch.kpatch"}, SpecError, "not found"),
    ({"kpatch_spec": "*.mlp: SwiGLU -> fused_swiglu(inplace=true)"}, SpecError, "did you mean 'in_place'"),
    ({"kpatch_strict": "yes"}, ValueError, "true or false"),
])
def test_bad_values_fail_when_parsed(kw, exc, frag):
    with pytest.raises(exc) as ei:
        patchdsl.PatchdslArguments(**kw)
    msg = ei.value.render() if isinstance(ei.value, SpecError) else str(ei.value)
    assert frag in msg


def test_dtype_aliases_and_comma_string():
    a = patchdsl.PatchdslArguments(kpatch_dtype="bfloat16, float32,bf16")
    assert a.kpatch_dtype == ["bf16", "fp32"]


def test_import_patchdsl_does_not_import_transformers():
    code = ("import sys, patchdsl; a = patchdsl.PatchdslArguments(kpatch_spec='qwen3'); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules); "
            "print(a.kpatch_spec)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["qwen3"]
    import transformers

    t = patchdsl.TrainingArguments
    assert issubclass(t, transformers.TrainingArguments) and (t.__module__, t.__name__) == ("patchdsl", "TrainingArguments")


def test_training_arguments_pickle_and_to_dict(tmp_path):
    import pickle

    ta = patchdsl.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], kpatch_spec="llama")
    back = pickle.loads(pickle.dumps(ta))          # Trainer saves training_args.bin this way
    assert type(back) is patchdsl.TrainingArguments and back.kpatch_spec == "llama"
    assert ta.to_dict()["kpatch_spec"] == "llama"
