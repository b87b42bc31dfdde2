"""A new user's first hour (issue 27): options that mean what they say, --json the same for every
command, exit codes, a plan one can read and grep, counts that agree, and every hint leading to a
spec that works (each hint's suggestion is applied and the result must plan).

Table-driven over the command line with click's CliRunner (stdout and stderr apart).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchdsl.cli import main
from patchdsl.training.workload import measured_steps

Q = "Qwen/Qwen3-0.6B"
ROOT = Path(__file__).resolve().parents[2]


def run(args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


# ---------------------------------------------------------------- options, exit codes, --json
# argv -> exit code, fragments of stderr.  Each fails before any model is built (cheap).
BAD_OPTIONS = {
    "apply --steps 0": (["apply", "qwen3", "-m", Q, "--steps", "0"], "--steps"),
    "apply --steps -1": (["apply", "qwen3", "-m", Q, "--steps", "-1"], "--steps"),
    "apply --batch 0": (["apply", "qwen3", "-m", Q, "--batch", "0"], "--batch"),
    "apply --seq 1": (["apply", "qwen3", "-m", Q, "--seq", "1"], "--seq"),
    "apply --lr 0": (["apply", "qwen3", "-m", Q, "--lr", "0"], "--lr"),
    "apply --lr nan": (["apply", "qwen3", "-m", Q, "--lr", "nan"], "--lr"),
    "apply --dtype fp64": (["apply", "qwen3", "-m", Q, "--dtype", "fp64"], "--dtype"),
    "apply --device tpu": (["apply", "qwen3", "-m", Q, "--device", "tpu"], "--device"),
    "verify --batch 0": (["verify", "qwen3", "-m", Q, "--batch", "0"], "--batch"),
    "verify --steps -1": (["verify", "qwen3", "-m", Q, "--steps", "-1"], "--steps"),
    "verify --seed -1": (["verify", "qwen3", "-m", Q, "--seed", "-1"], "--seed"),
    "plan without --model": (["plan", "qwen3"], "--model"),
    "plan, unknown model": (["plan", "qwen3", "-m", "no-such-org/no-such-model"], "no-such-org/no-such-model"),
    "check, no such spec": (["check", "/no/such.kpatch"], "not found"),
    "translate, nothing to translate": (["translate", "-m", Q], "--liger"),
    "translate --liger false": (["translate", "--liger", "false", "-m", Q], "turns Liger off"),
    "bench, no subcommand": (["bench"], "say which benchmark"),
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_bad_input_is_exit_2_with_a_message_and_no_traceback(name):
    args, fragment = BAD_OPTIONS[name]
    r = run(args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert fragment in r.stderr and "Traceback" not in r.output, r.output


JSON_COMMANDS = [n for n, (args, _) in BAD_OPTIONS.items() if args[0] not in ("bench",)]


@pytest.mark.parametrize("name", JSON_COMMANDS)
def test_json_errors_are_a_document_on_stdout(name):
    args, fragment = BAD_OPTIONS[name]
    r = run(args + ["--json"])
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and fragment in doc["error"]["message"], doc
    assert fragment in r.stderr                       # people still read the message on stderr


def test_every_command_has_the_same_json_option():
    """--json is cli.json_option wherever it appears (a new command takes it with @json_option)."""
    from patchdsl.cli.app import json_option

    ref = next(p for p in json_option(lambda **k: None).__click_params__)
    helps = {name: [p for p in cmd.params if "--json" in p.opts] for name, cmd in main.commands.items()}
    assert {"check", "plan", "codegen", "apply", "verify", "translate"} <= {n for n, ps in helps.items() if ps}
    for name, ps in helps.items():
        assert not ps or (len(ps) == 1 and ps[0].is_flag and ps[0].help == ref.help and ps[0].is_eager), name
    assert any("--json-out" in p.opts for p in main.commands["apply"].params)


@pytest.mark.parametrize("args", [["check", "qwen3"], ["plan", "qwen3", "-m", Q],
                                  ["translate", "--liger", '{"rms_norm": true}', "-m", Q]])
def test_json_success_is_one_document_on_stdout(args):
    r = run(args + ["--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, "abort"])
@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_is_exit_130(monkeypatch, raised, as_json):
    import click

    import patchdsl.cli.commands as cli        # where the plan command looks _read_spec up

    def interrupted(*a, **k):
        raise click.Abort() if raised == "abort" else KeyboardInterrupt()

    monkeypatch.setattr(cli, "_read_spec", interrupted)
    r = run(["plan", "qwen3", "-m", Q] + (["--json"] if as_json else []))
    assert r.exit_code == 130 and "interrupted" in r.stderr, r.output
    if as_json:
        assert json.loads(r.stdout)["exit_code"] == 130


def test_apply_and_verify_default_to_the_same_dtype():
    from patchdsl.cli.app import _default_dtype

    for name in ("apply", "verify"):
        opt = next(p for p in main.commands[name].params if p.name == "dtype")
        ctx = main.commands[name].make_context(name, ["qwen3", "-m", Q])
        assert ctx.params["dtype"] is None and "bf16 on GPU, fp32 on CPU" in opt.help, name
    assert (_default_dtype("cpu"), _default_dtype("cuda"), _default_dtype("cuda:1")) == ("fp32", "bf16", "bf16")


@pytest.mark.parametrize("warmup,steps,chunks", [(1, 3, [1, 1, 1, 1]), (0, 3, [1, 1, 1]), (3, 2, [1] * 5), (2, 4, [3, 3])])
def test_progress_counts_the_measured_steps(warmup, steps, chunks):
    seen, counted = 0, 0
    for n in chunks:
        counted += measured_steps(seen, seen + n, warmup)
        seen += n
    assert seen == warmup + steps and counted == steps


# ---------------------------------------------------------------- plans one can read and grep
def _plan_json(spec, model):
    r = run(["plan", spec, "-m", model, "--json"])
    d = json.loads(r.stdout)
    # a site the spec asks for (not optional) refused by the model is exit 2, the plan still printed
    assert r.exit_code == (2 if any(s["refused"] and not s.get("optional") for s in d["sites"]) else 0), r.output
    return d


@pytest.mark.parametrize("spec,model", [("qwen3", Q), ("specs/qwen3.kpatch", "meta-llama/Llama-3.2-1B"),
                                        ("gemma3", "google/gemma-3-1b-pt")])
def test_plan_counts_agree_everywhere(spec, model):
    d = _plan_json(spec, model)
    sites = [s for s in d["sites"] if not s["refused"]]
    fused = sum(len(s["covers"]) for s in sites)
    assert sum(t["patched"] for t in d["totals"]) == len(sites) + fused
    r = run(["plan", spec, "-m", model])
    assert r.exit_code == (2 if len(sites) < len(d["sites"]) else 0), r.output
    lines = r.stdout.splitlines()
    summary = lines[-1]
    want = f"{len(sites)} site(s) to patch" + (f" (+{fused} module(s) fused into them: {len(sites) + fused} modules"
                                                if fused else ",")
    assert summary.startswith(want), summary
    assert f", {len(d['sites']) - len(sites)} refused," in summary
    # the rule lines: patched and refused columns add up to the sites
    header = next(i for i, ln in enumerate(lines) if ln.startswith("rule "))
    rows = [ln for ln in lines[header + 1:] if re.match(r"\S+:\d+\s", ln) and not re.search(r": refused ", ln)]
    nums = [list(map(int, ln.split()[-3:])) for ln in rows]
    assert sum(n[0] for n in nums) == len(sites) and sum(n[1] for n in nums) == len(d["sites"]) - len(sites)
    assert lines[-2].startswith("modules patched: ")
    for t in d["totals"]:
        assert f"{t['patched']}/{t['present']} {t['name']}" in lines[-2]


def test_plan_default_is_a_line_per_rule_and_sites_a_line_per_site():
    d = _plan_json("qwen3", Q)
    short = run(["plan", "qwen3", "-m", Q]).stdout.splitlines()
    assert len(short) < 12 and any("fused_qk_norm_rope" in ln and "*.self_attn: Attention" in ln for ln in short)
    r = run(["plan", "qwen3", "-m", Q, "--sites"])
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    rows = {ln.split()[0]: ln for ln in lines[2:] if ln.startswith("model.") or ln.startswith("lm_head")}
    # one whole line per site and per fused module: every path intact, grep finds it
    want = [s["path"] for s in d["sites"]] + [c for s in d["sites"] for c in s["covers"]]
    assert sorted(rows) == sorted(want)
    assert "fused into fused_qk_norm_rope" in rows["model.layers.0.self_attn.q_norm"]
    assert "specs/qwen3.kpatch:6" in rows["model.layers.27.post_attention_layernorm"]
    at = lines[1].index("class")                       # fixed columns, not wrapped: every class where the header says
    assert all(ln[at - 2:at] == "  " and ln[at] != " " for ln in rows.values())


def test_plan_lines_are_never_wrapped_or_cut_whatever_the_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    r = run(["plan", "qwen3", "-m", Q, "--sites"])
    assert "model.layers.13.post_attention_layernorm" in r.stdout
    assert not any(ln.strip() in ("ernorm", "layernorm") for ln in r.stdout.splitlines())


def test_plan_without_its_spec_rules_still_has_a_line_per_rule():
    from patchdsl.planning import text as plantext
    from patchdsl.planning.plan import PatchPlan

    p = PatchPlan.from_json(_plan_json("qwen3", Q))
    lines = plantext.short_lines(p)                   # a plan file: no rule texts
    assert sum(1 for ln in lines if ln.startswith("specs/qwen3.kpatch:")) == 4


# ---------------------------------------------------------------- apply (one CPU run)
def test_apply_json_is_a_document_and_the_cpu_reports_no_speed(tmp_path):
    out = tmp_path / "numbers.json"
    r = run(["apply", "specs/qwen3.kpatch", "-m", Q, "--steps", "2", "--json", "--json-out", out])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["ok"] and doc["speed_measured"] is False and doc["workload"]["steps"] == 2
    for run_ in ("unpatched", "patched"):
        assert len(doc[run_]["losses"]) == 2 and "tokens_per_s" not in doc[run_]
    assert doc["patched_sites"] + doc["fused_modules"] == sum(t["patched"] for t in doc["totals"])
    assert not re.search(r"^tokens/s", r.stderr, re.M) and "not reported on the CPU" in r.stderr
    assert "specs/qwen3.kpatch:7" in r.stderr and "post_attention_layernorm " not in r.stderr   # the short plan
    # progress, a line per stage on stderr with the time so far, and the total time (issue 38)
    stages = re.findall(r"^\[apply +[\d.]+s\] (.*)$", r.stderr, re.M)
    assert [s.split(" ")[0] for s in stages] == ["building", "planning", "generating", "the", "training", "training"]
    assert re.search(r"^apply took [\d.]+ s in all$", r.stderr, re.M) and doc["total_s"] > 0


# ---------------------------------------------------------------- hints that lead to a spec that works
def _plans(spec_text: str, tmp_path, model=Q) -> None:
    f = tmp_path / "fixed.kpatch"
    f.write_text(spec_text)
    r = run(["plan", f, "-m", model])
    assert r.exit_code == 0 and ", 0 refused" in r.stdout.splitlines()[-1], r.output


KIND_TYPOS = ["RMSNrom", "rmsnorm", "RMSNor", "SwiGUL", "Attnetion", "Linaer"]


@pytest.mark.parametrize("typo", KIND_TYPOS)
def test_check_catches_kind_typos_and_the_hint_plans(typo, tmp_path):
    rule = {"RMSNorm": "*.input_layernorm: {} -> fused_rmsnorm\n", "SwiGLU": "*.mlp: {} -> fused_swiglu\n",
            "Attention": "*.self_attn: {} -> fused_qk_norm_rope\n",
            "Linear": "lm_head: {} -> fused_linear_cross_entropy\n"}
    kind = next(k for k in rule if sorted(k.lower()) == sorted(typo.lower()) or typo.lower() in (k.lower(), k.lower()[:-1])
                or len(typo) == len(k) - 1 and any(k[:i] + k[i + 1:] == typo for i in range(len(k))))
    spec = tmp_path / "typo.kpatch"
    spec.write_text(rule[kind].format(typo))
    r = run(["check", spec])
    assert r.exit_code == 2 and f"unknown kind '{typo}'" in r.stderr, r.output
    fix = re.search(r"did you mean '(\w+)'", r.stderr).group(1)
    _plans(rule[kind].format(fix), tmp_path)


@pytest.mark.parametrize("name", ["Qwen3RMSNorm", "GELU", "RMSNorm2", "Qwen3MLP"])
def test_check_accepts_class_names_near_kinds(name, tmp_path):
    spec = tmp_path / "cls.kpatch"
    spec.write_text(f"*.input_layernorm: {name} -> fused_rmsnorm\n")
    assert run(["check", spec]).exit_code == 0


@pytest.mark.parametrize("why", ["could not verify publisher trust status.", "is not from a trusted publisher."])
def test_hub_trust_hint_names_the_spec_flag_and_the_fixed_spec_plans(why, tmp_path, monkeypatch):
    kernels = pytest.importorskip("kernels")
    from patchdsl.ops import hub
    from tests.interop.test_hub_and_liger_ops import norm_repo

    repo = norm_repo(tmp_path / "repo")

    def get_kernel(repo_id, revision=None, version=None, trust_remote_code=False, **kw):
        if not trust_remote_code:
            raise ValueError(f"Kernel repository '{repo_id}' {why} Set trust_remote_code=True or add the repository "
                             "ID to the trust_remote_code allowlist to allow loading kernels from untrusted sources.")
        return kernels.get_local_kernel(Path(repo))

    monkeypatch.setattr(kernels, "get_kernel", get_kernel)
    monkeypatch.setattr(hub, "_hf_offline", lambda: False)
    monkeypatch.setattr(hub, "_LOADED", {})
    spec = 'model.norm: RMSNorm -> hub("some-org/norms", "TinyRMSNorm", version=1)\n'
    f = tmp_path / "h.kpatch"
    f.write_text(spec)
    r = run(["plan", f, "-m", Q])
    assert r.exit_code == 2 and "Set trust_remote_code=True" not in r.stderr and why.rstrip(".") in r.stderr, r.output
    call = re.search(r"hub\(.*trust_remote_code=true\)", r.stderr).group(0)
    assert call == 'hub("some-org/norms", "TinyRMSNorm", version=1, trust_remote_code=true)'
    _plans(f"model.norm: RMSNorm -> {call}\n", tmp_path)


def test_translate_folds_per_layer_problems_and_its_hint_plans(tmp_path):
    r = run(["translate", "--liger", '{"swiglu": true, "rms_norm": true}', "-m", "google/gemma-3-1b-pt"])
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "26 modules (model.layers.0.mlp, ...)" in errors[0], r.stderr
    use = re.search(r"use (\w+)", errors[0]).group(1)
    r = run(["translate", "--liger", json.dumps({use: True, "rms_norm": True}), "-m", "google/gemma-3-1b-pt"])
    assert r.exit_code == 0, r.output
    _plans(r.stdout, tmp_path, "google/gemma-3-1b-pt")


@pytest.mark.parametrize("value,shown", [("false", "false turns Liger off"), ("null", "null turns Liger off"),
                                         ('{"rope": "yes"}', 'got "yes"'), ("3", "got 3")])
def test_liger_values_are_shown_as_written_and_the_hint_translates(value, shown, tmp_path):
    r = run(["translate", "--liger", value, "-m", Q])
    assert r.exit_code == 2 and shown in r.stderr and "False" not in r.stderr, r.stderr
    m = re.search(r"--liger '(\{.*?\})'", r.stderr)
    if m:
        r = run(["translate", "--liger", m.group(1), "-m", Q])
        assert r.exit_code == 0, r.output
        _plans(r.stdout, tmp_path)


def test_codegen_files_are_readable_like_any_file_the_user_writes(tmp_path):
    old = os.umask(0o022)
    try:
        r = run(["codegen", "qwen3", "-m", Q, "--out", tmp_path / "k", "--json"])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    written = json.loads(r.stdout)["files"]
    assert written and all(stat.S_IMODE(os.stat(p).st_mode) == 0o644 for p in written)


def test_tiny_never_grows_a_users_config_and_says_what_it_shrank(tmp_path):
    from patchdsl.model import load_model

    cfg = json.loads((ROOT / "patchdsl/model/configs/Qwen__Qwen3-0.6B.json").read_text())
    cfg.update(vocab_size=300, num_hidden_layers=1)
    cfg.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    said = []
    m = load_model(tmp_path, meta=True, tiny=True, log=said.append).model
    assert m.config.vocab_size == 300 and m.config.num_hidden_layers == 1
    assert "vocab 300" in said[0] and "shrunk from" in said[0] and "1 layers" in said[0]


def test_verify_says_it_builds_random_weights_not_meta():
    r = run(["verify", "qwen3", "-m", Q, "--batch", "1", "--seq", "4", "--json"])
    assert r.exit_code in (0, 1), r.output
    assert "meta device" not in r.stderr and "random weights (seed 0)" in r.stderr
    assert json.loads(r.stdout)["ok"] is (r.exit_code == 0)


def test_unmeasured_hf_errors_show_as_a_dash_not_nan():
    from rich.console import Console

    from patchdsl.parity.report import Check, ParityReport

    rep = ParityReport("fp32", "cpu", "interpreter", "M", "s", 1, 4, 0, 0, 4.0, 1e-5)
    nan, inf = float("nan"), float("inf")
    rep.rows.append(Check("site", "model.norm", "fused_rmsnorm", "output", inf, inf, inf, nan, nan, False,
                          "the module did not run in the forward pass; nothing was compared"))
    c = Console(record=True, width=200)
    rep.render_table(c)
    text = c.export_text()
    assert "nan" not in text and "did not run" in text


@pytest.mark.parametrize("given,name", [("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.float16", "fp16"),
                                        ("float32", "fp32"), ("fp8", "fp8")])
def test_verify_takes_torch_dtypes_and_strings(given, name):
    import torch

    from patchdsl.util.vocab import canonical_dtype as _dtype_name

    assert _dtype_name(given) == name
    if given.startswith("torch."):
        assert _dtype_name(getattr(torch, given[6:])) == name
    assert _dtype_name(torch.bfloat16) == "bf16"


# ---------------------------------------------------------------- bench: exit status and where results go
@pytest.mark.parametrize("correct,code", [(True, 0), (False, 1), (None, 0)])
def test_bench_ops_exit_status_follows_the_kernel_results(correct, code, tmp_path, monkeypatch, capsys):
    from patchdsl_tools.bench import cli as bench_cli, runner

    def fake_run_ops(opts):
        rows = [{"op": "rmsnorm", "label": "6x256", "impl": "patchdsl", "group": "tiny", "status": "ok",
                 "host_fwd_us": 5000.0, "fwd_ms": 1.0, "correct": correct, "err_max": 0.5}]
        doc = {"kind": "patchdsl-bench-ops", "env": {"device": "cpu"}, "results": rows, "comparisons": [],
               "complete": True}
        Path(opts.json_path).write_text(json.dumps(doc))
        return doc

    monkeypatch.setattr(runner, "run_ops", fake_run_ops)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert bench_cli.run(["ops", "--device", "cpu", "--no-png"]) == code
    err = capsys.readouterr().err
    assert ("result was wrong" in err) is (code == 1)
    made = list((tmp_path / "bench-results").iterdir())
    assert len(made) == 1 and (made[0] / "ops.json").is_file() and not (tmp_path / "ops.json").exists()
    assert bench_cli.run(["summary", str(made[0] / "ops.json")]) == code
    assert "says nothing about speed" in capsys.readouterr().out      # CPU times are labelled as such


# ---------------------------------------------------------------- the README's two commands
def _readme_commands() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(pip install [^\n]+)\n```", text)
    return {"main": next(b for b in blocks if "patchdsl apply" in b), "test": next(b for b in blocks if "pytest" in b)}


def test_ci_runs_exactly_the_readmes_test_command_and_the_main_job_installs_no_extras():
    cmds = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert cmds["test"] in ci, (cmds["test"], ci)
    assert "pip install -e . " in cmds["main"] + " " and "[test]" not in cmds["main"]
    assert "pip install -e '.[test]'" in cmds["test"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in (ROOT / "README.md").read_text()
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!; \[]", d)[0].lower() for d in deps}
    assert not names & {"pytest", "hypothesis", "deepspeed", "trl", "peft", "kernels"}, names
    assert "accelerate" in names          # transformers' Trainer needs it: the README's training example runs


BLOCK_EXTRAS = """
import importlib.abc, importlib.metadata, importlib.util, sys
EXTRAS = {"pytest", "hypothesis", "deepspeed", "trl", "peft", "kernels", "liger_kernel", "matplotlib"}
def blocked(name):
    return str(name).split(".")[0].replace("-", "_").lower() in EXTRAS
class Block(importlib.abc.MetaPathFinder):          # as if not installed: not importable, not found,
    def find_spec(self, name, path=None, target=None):            # no distribution metadata
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
_find, _version, _dist = importlib.util.find_spec, importlib.metadata.version, importlib.metadata.distribution
importlib.util.find_spec = lambda name, package=None: None if blocked(name) else _find(name, package)
def version(name):
    if blocked(name):
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)
def distribution(name):
    if blocked(name):
        raise importlib.metadata.PackageNotFoundError(name)
    return _dist(name)
importlib.metadata.version, importlib.metadata.distribution = version, distribution
import patchdsl.training.workload, patchdsl.runtime, patchdsl.codegen, patchdsl.planning.text
from patchdsl.cli import main
main(["plan", "qwen3", "-m", "Qwen/Qwen3-0.6B"], prog_name="patchdsl")
"""


def test_plan_and_apply_need_none_of_the_extras():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", BLOCK_EXTRAS], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0 and "site(s) to patch" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_verify_report_lines_are_whole_when_not_on_a_terminal():
    from patchdsl.parity.report import Check, ParityReport

    rep = ParityReport("fp32", "cpu", "interpreter", "Qwen3ForCausalLM", "s", 1, 4, 0, 0, 4.0, 1e-5)
    path = "model.layers.13.post_attention_layernorm"
    rep.sites.append({"path": path, "op": "fused_rmsnorm", "host": path})
    rep.rows.append(Check("site", path, "fused_rmsnorm", "grad_weight", 1e-7, 1e-6, 2e-7, 1e-7, 4e-7, True))
    rep.rows.append(Check("site", path, "fused_rmsnorm", "output", 1.0, 1.0, 0.5, 1e-7, 4e-7, False))
    lines = rep.plain_lines()
    assert [ln.split()[0] for ln in lines[2:4]] == ["ok", "FAIL"] and all(path in ln for ln in lines[2:4])
    assert lines[-1].startswith("FAIL: 1 of 1 site(s) failed")
