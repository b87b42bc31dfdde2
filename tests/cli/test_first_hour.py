"""A new user's first hour, round three (issue 38): each item a class closed, each test one that
failed before.  Cheap by construction: meta-device and tiny models, verdicts that come before any
run, subprocesses only where the property is about a process (a closed pipe, what --help imports,
a traceback)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchdsl.cli import main

ROOT = Path(__file__).resolve().parents[2]
Q = "Qwen/Qwen3-0.6B"
SHIPPED = sorted(p.stem for p in (ROOT / "specs").glob("*.kpatch"))


def run(args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def two_layer_qwen3(tmp_path) -> str:
    """Qwen3-0.6B's shipped config with 2 layers: its modules, planned in a fraction of the time."""
    cfg = json.loads((ROOT / "patchdsl/model/configs/Qwen__Qwen3-0.6B.json").read_text())
    cfg.update(num_hidden_layers=2, max_window_layers=2)
    cfg.pop("layer_types", None)
    (tmp_path / "q2").mkdir(exist_ok=True)
    (tmp_path / "q2" / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "q2" / "config.json")


# ---------------------------------------------------------------- a closed stdout: quiet, 141, every command
@pytest.mark.parametrize("args", [["plan", "qwen3", "-m", "{model}", "--sites"], ["check", "qwen3", "--json"],
                                  ["--help"]], ids=["plan --sites", "check --json", "--help"])
def test_a_reader_that_closes_early_ends_the_command_quietly(args, tmp_path):
    """`patchdsl plan ... --sites | head -1`: the reader is gone before the command writes (closed at
    once, so the test does not race the pipe's buffer), as a Unix tool: status 141, nothing on stderr."""
    r, w = os.pipe()
    args = [a.format(model=two_layer_qwen3(tmp_path)) for a in args]
    p = subprocess.Popen([sys.executable, "-m", "patchdsl.cli", *args], stdout=w, stderr=subprocess.PIPE,
                         env=_env(), cwd=ROOT)
    os.close(w)
    os.close(r)
    err = p.stderr.read().decode()
    p.wait(timeout=300)
    assert p.returncode == 141, (p.returncode, err[-2000:])
    assert not re.search(r"Traceback|internal error|Broken ?pipe|Exception ignored", err, re.I), err[-2000:]


# ---------------------------------------------------------------- --help: imports no torch, lists specs/
HELP_IMPORTS = """
import json, sys
from patchdsl.cli import main
out = {}
for name in [None] + sorted(n for n in main.commands if n != "bench"):
    try:
        main([name, "--help"] if name else ["--help"], prog_name="patchdsl")
    except SystemExit as e:
        out[name or "patchdsl"] = [e.code, [m for m in ("torch", "triton", "transformers") if m in sys.modules]]
print(json.dumps(out), file=sys.stderr)
"""


def test_help_of_every_command_imports_no_torch():
    p = subprocess.run([sys.executable, "-c", HELP_IMPORTS], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=120)
    got = json.loads(p.stderr.strip().splitlines()[-1])
    assert set(got) >= {"patchdsl", "apply", "verify", "plan"}, got
    assert all(v == [0, []] for v in got.values()), got


def test_every_list_of_shipped_specs_is_specs_folder():
    """The top-level help and PatchdslArguments' help are built from specs/ when read; docs/training.md
    is checked against it here (a spec added later must be added there)."""
    import patchdsl

    text = " ".join(run(["--help"]).stdout.split())
    listed = re.search(r"name of a shipped spec \(([^)]*)\)", text).group(1)
    assert [n.strip() for n in listed.split(",")] == SHIPPED, listed
    import dataclasses

    helptext = next(f for f in dataclasses.fields(patchdsl.PatchdslArguments) if f.name == "kpatch_spec").metadata["help"]
    assert all(n in re.findall(r"\w+", helptext) for n in SHIPPED), helptext
    row = next(ln for ln in (ROOT / "docs" / "training.md").read_text().splitlines() if ln.startswith("| `kpatch_spec`"))
    in_docs = re.search(r"a shipped name \(([^;)]*)", row).group(1)
    assert re.findall(r"`(\w+)`", in_docs) == SHIPPED, in_docs


# ---------------------------------------------------------------- hints that lead to something that works
@pytest.mark.parametrize("liger, fits_nothing", [('{"layer_norm": true}', "layer_norm"),
                                                  ('{"geglu": true, "swiglu": false}', "geglu"),
                                                  ('{"relu_squared": true}', "relu_squared")])
def test_translate_hint_is_a_command_that_translates(liger, fits_nothing, tmp_path):
    """A Liger key that fits nothing on the model (an MoE with RMSNorms and SwiGLU experts): the hint was
    "follow the 'use ...' above" where no 'use' was printed; it is a whole command now, and running it
    translates a spec that plans."""
    cfg = json.loads((ROOT / "patchdsl/model/configs/Qwen__Qwen3-30B-A3B.json").read_text())
    cfg.update(num_hidden_layers=2, max_window_layers=2, num_experts=8)   # its modules, fewer of them (cheap)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = str(tmp_path / "config.json")
    r = run(["translate", "--liger", liger, "--model", model])
    assert r.exit_code == 2 and f"error: {fits_nothing}: " in r.stderr, r.output
    hint = next(ln for ln in r.stderr.splitlines() if ln.startswith("hint: "))
    argv = shlex.split(hint.removeprefix("hint: ").split(" translates ")[0])
    assert argv[:2] == ["patchdsl", "translate"], hint
    r2 = run(argv[1:])
    assert r2.exit_code == 0 and "rms_norm" in r2.stdout, r2.output
    spec = tmp_path / "t.kpatch"
    spec.write_text(r2.stdout)
    p = run(["plan", spec, "-m", model])
    assert p.exit_code == 0 and ", 0 refused" in p.stdout.splitlines()[-1], p.output


@pytest.mark.parametrize("where", ["--dtype", "spec", "kpatch_dtype", "load_model"])
def test_fp8_as_a_dtype_points_at_fp8_linear_with_a_rule_that_plans(where, tmp_path):
    from patchdsl.util.vocab import FP8_RULE

    if where == "--dtype":
        r = run(["verify", "qwen3", "-m", Q, "--dtype", "fp8"])
        assert r.exit_code == 2, r.output
        msg = r.stderr
    elif where == "spec":
        f = tmp_path / "d.kpatch"
        f.write_text("dtype fp8\nmodel.norm: RMSNorm -> fused_rmsnorm\n")
        r = run(["check", f])
        assert r.exit_code == 2, r.output
        msg = r.stderr
    elif where == "kpatch_dtype":
        import patchdsl

        with pytest.raises(ValueError) as e:
            patchdsl.PatchdslArguments(kpatch_dtype=["fp8"])
        msg = str(e.value)
    else:
        from patchdsl.model import load_model
        from patchdsl.model.loading import ModelLoadError

        with pytest.raises(ModelLoadError) as e:
            load_model(Q, dtype="float8_e4m3fn", meta=True, log=None)
        msg = str(e.value)
    assert "fp8_linear" in msg and FP8_RULE in msg, msg


def test_the_fp8_hints_rule_plans(tmp_path):
    from patchdsl.util.vocab import FP8_RULE

    # the hint's rule, in a bf16 spec (emulate=true: this CPU has no fp8), plans every site it names
    f = tmp_path / "fp8.kpatch"
    f.write_text("dtype bf16\n" + FP8_RULE.replace("recipe=rowwise", "recipe=rowwise, emulate=true") + "\n")
    p = run(["plan", f, "-m", two_layer_qwen3(tmp_path)])
    assert p.exit_code == 0 and p.stdout.splitlines()[-1].startswith("6 site(s) to patch, 0 refused"), p.output


# ---------------------------------------------------------------- configs: the family's names, transformers' defaults
ATTRIBUTE_MAP_FAMILIES = ["gpt2", "gpt_bigcode", "bloom", "gptj", "gpt_neo", "codegen", "openai-gpt", "xglm", "mpt",
                          "ctrl"]


@pytest.fixture(scope="module")
def default_config_files(tmp_path_factory):
    from transformers import AutoConfig

    d = tmp_path_factory.mktemp("cfgs")
    out = {}
    for mt in ATTRIBUTE_MAP_FAMILIES:
        (d / mt).mkdir()
        (d / mt / "config.json").write_text(AutoConfig.for_model(mt).to_json_string())
        out[mt] = d / mt / "config.json"
    return out


@pytest.mark.parametrize("family", ATTRIBUTE_MAP_FAMILIES)
def test_tiny_models_of_families_whose_sizes_go_by_other_names(family, default_config_files):
    """GPT-2 calls its heads n_head (attribute_map): the tiny step read to_dict()['num_attention_heads']."""
    from patchdsl.model import load_model
    from patchdsl.model.config_names import attribute_map as _amap
    from patchdsl.model.hf import config_class

    def attribute_map(model_type):
        return _amap(config_class(model_type))

    assert "num_attention_heads" in attribute_map(family) or "hidden_size" in attribute_map(family)
    said = []
    m = load_model(default_config_files[family], tiny=True, meta=True, log=said.append).model
    full = json.loads(default_config_files[family].read_text())
    c = m.config
    assert c.hidden_size <= min(160, full[attribute_map(family).get("hidden_size", "hidden_size")]), said
    assert c.num_hidden_layers <= 2 and c.vocab_size <= 512 and "shrunk from" in said[0], said


def test_verify_builds_a_tiny_gpt2_and_gives_its_verdict(default_config_files, tmp_path):
    spec = tmp_path / "none.kpatch"
    spec.write_text("optional *.mlp: SwiGLU -> fused_swiglu\n")
    r = run(["verify", spec, "-m", default_config_files["gpt2"], "--json"])
    assert r.exit_code == 1, r.output                     # a verdict (nothing patched), not exit 3
    assert "tiny gpt2" in r.stderr and json.loads(r.stdout)["ok"] is False


def test_config_checks_name_the_familys_own_field():
    from transformers import AutoConfig

    from patchdsl.model.loading import ModelLoadError, check_config_dict

    d = AutoConfig.for_model("gpt2").to_dict()
    d["n_head"] = "x"
    with pytest.raises(ModelLoadError, match='"n_head" must be a positive integer'):
        check_config_dict(d)


def _lm_families():
    from transformers.models.auto import modeling_auto as ma

    return sorted(set(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def test_transformers_own_default_configs_pass_the_config_checks():
    """Every causal-LM / image-text-to-text family's default config as transformers builds it (Qwen2-MoE:
    sliding_window 0 with use_sliding_window false; Gemma-3n: a size per layer; GLM-5: head_dim 0 of
    NoPE MLA) passes; a family whose default config transformers itself refuses is left out."""
    import warnings

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from patchdsl.model.loading import ModelLoadError, check_config_dict

    refused, checked = [], 0
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        for mt in _lm_families():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    d = CONFIG_MAPPING[mt]().to_dict()
            except Exception:
                continue
            checked += 1
            try:
                check_config_dict(d)
            except ModelLoadError as e:
                refused.append(f"{mt}: {e}")
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert checked > 150 and not refused, refused


@pytest.mark.parametrize("edit, field", [({"use_sliding_window": True}, "sliding_window"),
                                         ({"intermediate_size": [64, 0]}, "intermediate_size")])
def test_what_the_config_does_use_is_still_checked(edit, field):
    from transformers import AutoConfig

    from patchdsl.model.loading import ModelLoadError, check_config_dict

    d = AutoConfig.for_model("qwen2_moe").to_dict()
    d.update(edit)
    with pytest.raises(ModelLoadError, match=f'"{field}" must be a positive integer'):
        check_config_dict(d)


def _transformers_records():
    records = []
    h = logging.Handler()
    h.emit = lambda r: records.append(r)
    return records, h


def test_a_local_config_without_a_dtype_warns_nothing_about_torch_dtype(tmp_path):
    import warnings

    from patchdsl.model import load_model

    cfg = json.loads((ROOT / "patchdsl/model/configs/Qwen__Qwen3-0.6B.json").read_text())
    for k in ("torch_dtype", "dtype"):
        cfg.pop(k, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import transformers

    records, h = _transformers_records()
    lg = logging.getLogger("transformers")
    lg.addHandler(h)
    getattr(logging.Logger.warning_once, "cache_clear", lambda: None)()   # once per process: forget earlier ones
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()           # the tests' conftest quiets transformers to errors
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            load_model(tmp_path, tiny=True, meta=True, log=None)
            load_model(tmp_path, meta=True, log=None)
    finally:
        lg.removeHandler(h)
        transformers.logging.set_verbosity(verbosity)
    said = [r.getMessage() for r in records] + [str(x.message) for x in w]
    assert not [m for m in said if "torch_dtype" in m], said


def test_a_tiny_config_is_said_to_be_already_tiny(tmp_path):
    from patchdsl.model import load_model
    from patchdsl.model.shrink import tiny_config

    tiny = tiny_config(load_model(Q, meta=True, log=None).model.config)
    d = tiny.to_dict()
    d.pop("transformers_version", None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    said = []
    load_model(tmp_path, tiny=True, meta=True, log=said.append)
    assert "already tiny" in said[0] and "shrunk from" not in said[0], said


# ---------------------------------------------------------------- full size: the memory it takes, said first
@pytest.fixture
def small_machine(monkeypatch):
    """1 GiB free, and any real (non-meta) build an error: a refusal must come before allocating."""
    import patchdsl.model.loading as loading
    import patchdsl.model.memory as memory

    monkeypatch.setattr(memory, "free_memory", lambda device: 2 ** 30)
    real = loading._build

    def guarded(cfg, **kw):
        assert kw["meta"] or kw["tiny"], "a full-size model was being built"
        return real(cfg, **kw)

    monkeypatch.setattr(loading, "_build", guarded)


@pytest.mark.parametrize("cmd", ["apply", "verify"])
def test_full_size_that_does_not_fit_is_refused_up_front(cmd, small_machine):
    r = run([cmd, "qwen3", "-m", Q, "--full", "--device", "cpu"])
    assert r.exit_code == 2, (r.exit_code, r.output[-2000:])
    assert re.search(r"estimated ~[\d.,]+ GiB, 1\.0 GiB available on this machine: not started", r.stderr), r.stderr
    assert "--tiny" in r.stderr and "Traceback" not in r.output


def test_load_model_refuses_a_full_build_that_does_not_fit_and_says_what_fits(small_machine):
    from patchdsl.model import load_model
    from patchdsl.model.loading import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"building the qwen3 architecture at its full sizes \([\d.]+[MB] parameters"):
        load_model(Q, weights=False, log=None)
    said = []
    load_model(Q, weights=False, tiny=True, log=said.append)       # what the message offers works
    assert "tiny qwen3" in said[0]


# ---------------------------------------------------------------- a spec that patches nothing: the verdict first
def test_verify_and_apply_of_a_spec_that_patches_nothing_fail_before_running(tmp_path, monkeypatch):
    import patchdsl.parity.run as prun
    import patchdsl.training.workload as wl

    spec = tmp_path / "other.kpatch"
    spec.write_text("optional *.mlp: GeGLU -> fused_geglu\n")       # Gemma's MLP: Qwen3's is a SwiGLU

    def no_forward(*a, **k):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(prun, "_forward_backward", no_forward)
    monkeypatch.setattr(wl, "train", no_forward)
    r = run(["verify", spec, "-m", Q, "--json"])
    assert r.exit_code == 1, r.output[-2000:]
    assert "the spec patches nothing on Qwen3ForCausalLM" in json.loads(r.stdout)["verdict"]
    r = run(["apply", spec, "-m", Q, "--json"])
    assert r.exit_code == 1, r.output[-2000:]
    doc = json.loads(r.stdout)
    assert doc["trained"] is False and doc["unpatched"]["losses"] == [] and "patches nothing" in doc["parity"]["verdict"]
    assert "not trained" in r.stderr and "apply took" in r.stderr


# ---------------------------------------------------------------- training: verdicts shown, spec errors located
@pytest.fixture
def warning_level():
    """transformers' default verbosity (an earlier Trainer with log_level info may have changed it), and
    the records transformers.trainer's logger lets through at that level."""
    import transformers

    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    records, h = _transformers_records()
    lg = logging.getLogger("transformers.trainer")
    lg.addHandler(h)
    yield records
    lg.removeHandler(h)
    transformers.logging.set_verbosity(old)


@pytest.mark.parametrize("rule, passed", [("model.norm: RMSNorm -> fused_rmsnorm", True),
                                          ("model.norm: RMSNorm -> fused_rmsnorm(offset=1)", False)])
def test_kpatch_verify_verdict_shows_at_the_default_log_level(rule, passed, warning_level):
    import patchdsl
    from patchdsl.training.trainer import KpatchVerifyFailed

    from ..families import tiny_model

    model = tiny_model("qwen3", vocab_size=256)
    args = patchdsl.PatchdslArguments(kpatch_spec=rule, kpatch_verify=True)
    if passed:
        patchdsl.patch_for_training(model, args).undo()
    else:
        with pytest.raises(KpatchVerifyFailed):
            patchdsl.patch_for_training(model, args)
    shown = [(r.levelno, r.getMessage()) for r in warning_level if r.levelno >= logging.WARNING]
    verdict = [(lv, m) for lv, m in shown if m.startswith("patchdsl verify (kpatch_verify): ")]
    assert len(verdict) == 1, shown
    assert verdict[0][1].split(": ", 1)[1].startswith("PASS" if passed else "FAIL")
    assert verdict[0][0] == (logging.WARNING if passed else logging.ERROR)
    if passed:                                              # and what was patched (kpatch_log: totals)
        assert any("1/1 norm patched" in m for _, m in shown), shown


BAD_SPEC = """
import patchdsl
patchdsl.PatchdslArguments(kpatch_spec="*.mlp: SwiGLU -> fused_swigul")
"""


def test_a_bad_kpatch_spec_is_a_located_error_without_a_traceback():
    p = subprocess.run([sys.executable, "-c", BAD_SPEC], capture_output=True, text=True, env=_env(), cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("<string>:1:18: error: unknown op 'fused_swigul'") and "did you mean 'fused_swiglu'" \
        in p.stderr, p.stderr


def test_the_example_writes_outside_the_checkout_by_default(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_sft_example", ROOT / "examples" / "train_sft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(ROOT)
    def parsed(*argv):
        monkeypatch.setattr(sys, "argv", ["train_sft.py", *argv])
        return mod.parse()[0]

    for argv in ([], [str(ROOT / "examples" / "train_sft.yaml")], ["--kpatch_spec", "qwen3"]):
        out = Path(parsed(*argv).output_dir).resolve()
        assert ROOT not in out.parents and out != ROOT, (argv, out)
    assert Path(parsed("--output_dir", "mine").output_dir) == Path("mine")    # still the user's choice
