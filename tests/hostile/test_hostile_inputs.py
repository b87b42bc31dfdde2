"""The hostile-input suite (issue 22): what patchdsl does with input made to break it, each case
with its expected outcome.  docs/reliability.md lists the guarantees and points here.

Sections: plan files (generic over the op registry, Hub sites, attention, model coverage), CLI
file arguments (FIFO, /dev/zero, folders, deep nesting, huge integers, non-UTF-8, long names),
translate inputs, training arguments, flag bounds (generic over the registry), and apply's verdict.
Label values are tested in tests/kernels/test_cross_entropy.py (the label table), kernel-cache
plants in tests/hostile/test_cache_safety.py, the float64 fuzzing of plan files in tests/hostile/test_fuzz_plan.py.

Every case that could hang runs under an alarm (a hang fails the test instead of the CI run).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import os
import re
import shlex
import signal
import textwrap

import pytest
import torch
from click.testing import CliRunner

import patchdsl
from patchdsl.planning.check import check_spec
from patchdsl.cli import main
from patchdsl.model.index import build_index
from patchdsl.ops.registry import get_op, ops
from patchdsl.planning.plan import PatchPlan, plan_index
from patchdsl.planning.plan_file import PlanError
from patchdsl.planning.site_check import model_checker
from patchdsl.planning.planner import plan
from patchdsl.runtime import PatchError, apply
from patchdsl.syntax import SpecError, parse_spec

from ..families import tiny_model
from ..kernels.helpers import DEVICE

ALARM_S = 60


@contextlib.contextmanager
def no_hang(seconds: int = ALARM_S):
    """Fail (not hang) when the body runs longer than ``seconds``."""
    def boom(*_):
        raise TimeoutError(f"hung for {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def one_line(msg: str) -> None:
    assert "Traceback" not in msg and len(msg) < 2000, msg[:2000]


# ====================================================================== plan files, every op
# For every registered op, a plan with one site of it, made by the planner on a tiny model: the
# first module of a kind the op replaces, on the first model that has one, where the plan keeps
# the site (not refused).  External ops this machine cannot run (Liger on the CPU) are planned
# without the availability check (plan files meet that check at apply).  An op added later is found here by its kinds; one that
# needs arguments gets them from OP_ARGS (a new external op must add its line: the test says so).
POOL = {
    "qwen3": lambda: tiny_model("qwen3"),
    "llama": lambda: tiny_model("llama"),
    "gemma3": lambda: tiny_model("gemma3"),
    "phi": lambda: _tiny_phi(),
    "qwen3_moe": lambda: _tiny_moe(),
    "qwen3_next": lambda: _tiny_qwen3_next(),     # GatedRMSNorm (issue 25)
}


def _tiny_qwen3_next():
    from ..model.test_gated_norms import tiny_qwen3_next

    return tiny_qwen3_next()


def _tiny_phi():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("phi", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                               num_attention_heads=4, vocab_size=160, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _tiny_moe():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               vocab_size=160, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


_MODELS: dict[str, tuple] = {}


def pool_model(name):
    """(model, its index, its checker), built once."""
    if name not in _MODELS:
        m = POOL[name]()
        _MODELS[name] = (m, build_index(m), model_checker(m))
    return _MODELS[name]


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    from ..interop.test_hub_and_liger_ops import norm_repo

    pytest.importorskip("kernels")
    return norm_repo(tmp_path_factory.mktemp("hubrepo") / "good")


def op_args(op: str, repo) -> str:
    # fp8_linear is refused where fp8 matmuls cannot run (this CPU); its emulation plans everywhere
    return {"hub": f'("{repo}", "TinyRMSNorm")', "fp8_linear": "(emulate=true)"}.get(op, "")


def example_plan(op_name: str, repo):
    """(model name, plan) with one site of ``op_name`` (one the model does not refuse when there
    is one; else a refused one: a plan file's site is built and checked the same way), or None."""
    op = get_op(op_name)
    kinds = [k for k in op.kinds if op_name != "hub" or k == "RMSNorm"]
    from patchdsl.codegen.env import target as detect_target
    from patchdsl.planning.availability import check_available

    fallback = None
    for mname, dtype in [(m, d) for d in ("fp32", "bf16") for m in POOL]:
        model, index, checker = pool_model(mname)
        seen = set()
        for info in index:
            for kind in kinds:
                leaf = (info.cls, kind, info.path.rsplit(".", 1)[-1])
                if kind not in info.kinds or leaf in seen:
                    continue
                seen.add(leaf)
                rule = f"dtype {dtype}\n{info.path or '*'}: {kind} -> {op_name}{op_args(op_name, repo)}\n"
                try:                                 # as plan(): availability and pins included
                    checked = check_spec(parse_spec(rule))
                    p = check_available(checked, plan_index(checked, index, target=detect_target(),
                                                            check=checker), type(model))
                except SpecError:
                    if not op.external:
                        continue
                    try:                             # an external op this machine cannot run (Liger)
                        p = plan_index(check_spec(parse_spec(rule)), index, target=detect_target(), check=checker)
                    except SpecError:
                        continue
                if p.sites and not p.sites[0].refused:
                    return mname, p
                if p.sites and fallback is None:
                    fallback = (mname, p)
    return fallback


OPS = sorted(ops())


@pytest.fixture(scope="module")
def examples(hub_repo):
    return {name: example_plan(name, hub_repo) for name in OPS}


def test_every_registered_op_has_an_example_plan(examples):
    """A new op is covered by the generic plan-file cases below only if the pool has a module it
    takes (add a model to POOL) or it gets its arguments (OP_ARGS)."""
    missing = [n for n, e in examples.items() if e is None]
    assert not missing, f"no example plan for {missing}: extend POOL or op_args in tests/hostile/test_hostile_inputs.py"


# Hostile values put in place of each flag, each recorded kernel parameter and the recorded source.
HOSTILE_VALUES = [None, True, -1, 0, 2 ** 70, -2 ** 70, 1e308, 0.5, "", "auto", "x\nimport os",
                  "__import__('os').system('true')", "a" * 5000, [], [1], {}, {"a": 1}]


def _plan_paths(d: dict, idx: int):
    """Paths (from the plan's root) of every value of site ``idx`` and of its module's facts."""
    site = d["sites"][idx]
    for name in site.get("flags", {}):
        yield ("sites", idx, "flags", name)
    for i, k in enumerate(site.get("kernels", [])):
        for name in k.get("params", {}):
            yield ("sites", idx, "kernels", i, "params", name)
    for name in ("source", "op", "host", "class", "covers"):
        yield ("sites", idx, name)
    for kind, facts in d["modules"][site["path"]]["kinds"].items():
        for name in facts:
            yield ("modules", site["path"], "kinds", kind, name)


def _put(d, path, value):
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


@pytest.mark.slow
@pytest.mark.parametrize("op_name", OPS)
def test_plan_file_values_replaced_load_as_derived_or_fail_cleanly(op_name, examples, tmp_path, monkeypatch):
    """Every flag, kernel parameter, the source, op, host, class and covers of one site of each op,
    and every fact of its module, replaced by each hostile value: the plan file loads with its site
    exactly as build_site derives it (the recorded source never read) or fails with a one-line
    PlanError; nothing else, nothing written."""
    monkeypatch.setenv("PATCHDSL_CACHE", str(tmp_path / "cache"))
    _, p = examples[op_name]
    base = p.to_json()
    assert PatchPlan.from_json(base).sites == p.sites          # the unmodified plan loads as made
    idx = next(i for i, s in enumerate(base["sites"]) if s["op"] == op_name)
    outcomes = {"loaded": 0, "refused": 0}
    for path in _plan_paths(base, idx):
        for v in HOSTILE_VALUES:
            d = copy.deepcopy(base)
            _put(d, path, v)
            try:
                q = PatchPlan.from_json(d)
            except PlanError as e:
                msg = str(e)
                assert "\n" not in msg and len(msg) < 600, (path, v, msg)
                outcomes["refused"] += 1
                continue
            s = q.sites[idx]
            op = get_op(s.op)
            if op.external:           # the source is derived from the key, whatever the file said
                assert s.source == op.source(s.keys[0].param_dict), (path, v)
            if path[-1] == "source":
                assert s.keys == p.sites[idx].keys
            outcomes["loaded"] += 1
    assert outcomes["refused"] > 0
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("op_name", OPS)
def test_every_ops_plan_file_site_meets_the_availability_check_at_apply(op_name, examples):
    """apply of each op's example plan file: an external kernel this machine cannot have is a
    PlanError naming the site before anything is patched; otherwise the site is patched or refused
    with a reason (never another exception)."""
    mname, p = examples[op_name]
    model = copy.deepcopy(pool_model(mname)[0])
    q = PatchPlan.from_json(p.to_json())
    site = next(s for s in q.sites if s.op == op_name)
    op = get_op(op_name)
    why = op.unavailable(site.keys[0].param_dict) if op.external and site.keys else None
    if why:
        with pytest.raises(PlanError, match=rf"{re.escape(site.path)}.*cannot be used here"):
            apply(q, model, strict=False)
        assert not any("forward" in m.__dict__ for m in model.modules())
        return
    with apply(q, model, strict=False) as h:
        assert site.path in h.patched or any(r.path == site.path and r.reason for r in h.refused)


# ====================================================================== plan files: Hub sites
def _hub_plan(repo, model):
    from ..interop.test_hub_and_liger_ops import hub_spec

    return patchdsl.plan(hub_spec(repo, "model.norm"), model, dtypes=("fp32",))


def _hub_site(d):
    return next(s for s in d["sites"] if s["op"] == "hub")


def _set_hub(d, **kw):
    """Set a hub site's flag and its kernel parameter alike (``local`` is a parameter only)."""
    s = _hub_site(d)
    for k, v in kw.items():
        if k in s["flags"]:
            s["flags"][k] = v
        s["kernels"][0]["params"][k] = v


def _plant_pyc(repo):
    """A __pycache__ .pyc next to the layer's module that would print 'pwned' when imported."""
    import importlib.util

    mods = [p for p in repo.rglob("*.py")]
    for m in mods:
        cache = m.parent / "__pycache__"
        cache.mkdir(exist_ok=True)
        code = compile("raise SystemExit('pwned')", str(m), "exec")
        import marshal

        data = importlib.util.MAGIC_NUMBER + b"\0" * 12 + marshal.dumps(code)
        (cache / f"{m.stem}.{__import__('sys').implementation.cache_tag}.pyc").write_bytes(data)


def _append_code(repo):
    for m in repo.rglob("*.py"):
        m.write_text(m.read_text() + "\nraise SystemExit('pwned')\n")


# (name, edit of the plan JSON (d, repo, evil) or None, edit of the files after planning or None,
#  expected: "loads" | ("load", PlanError regex) | ("apply", PlanError regex))
HUB_CASES = [
    ("unmodified", None, None, "loads"),
    ("recorded source text changed", lambda d, r, e: _hub_site(d).update(source="local /elsewhere layer X"), None,
     "loads"),
    ("sha256 pin dropped", lambda d, r, e: _set_hub(d, sha256=None), None, ("load", r"no sha256 pin")),
    ("repo swapped for another folder, old pin kept", lambda d, r, e: _set_hub(d, repo=str(e)), None,
     ("apply", r"not the ones the plan recorded")),
    ("sha256 not hex", lambda d, r, e: _set_hub(d, sha256="z" * 64), None, ("load", r"sha256= must be 64")),
    ("Hub id without version or revision, trust_remote_code", lambda d, r, e: _set_hub(
        d, repo="evil-org/kernels", sha256=None, trust_remote_code=True, local=False), None,
     ("load", r"needs version= or revision=|version=N")),
    ("Hub id with a local sha256 pin", lambda d, r, e: _set_hub(d, repo="evil-org/kernels", version=1, local=False),
     None, ("load", r"sha256= pins a local folder")),
    ("revision with a space", lambda d, r, e: _set_hub(d, repo="org/k", sha256=None, local=False,
                                                        revision='x";$(touch /tmp/p)'),
     None, ("load", r"revision= must be a branch, tag or commit")),
    # a pinned Hub id that is not in the offline cache: refused at apply, the hint's command quoted
    ("revision with quotes and a shell substitution", lambda d, r, e: _set_hub(
        d, repo="org/k", sha256=None, local=False, revision='x";$(id)'),
     None, ("apply", r"""HF_HUB_OFFLINE.*'from kernels import get_kernel; get_kernel\("org/k", revision="x\\";\$\(id\)"\)'""")),
    ("code changed after planning", None, _append_code, ("apply", r"not the ones the plan recorded")),
    ("bytecode planted after planning", None, _plant_pyc, ("apply", r"not the ones the plan recorded")),
]


@pytest.mark.parametrize("name, edit, files, expected", HUB_CASES, ids=[c[0] for c in HUB_CASES])
def test_hub_sites_of_a_plan_file_are_pinned(name, edit, files, expected, tmp_path):
    from ..interop.test_hub_and_liger_ops import norm_repo

    pytest.importorskip("kernels")
    repo = norm_repo(tmp_path / "good")
    evil = norm_repo(tmp_path / "evil", err=0.5)
    model = tiny_model("qwen3")
    d = _hub_plan(repo, model).to_json()
    if edit is not None:
        edit(d, repo, evil)
    if files is not None:
        files(repo)
    if isinstance(expected, tuple) and expected[0] == "load":
        with pytest.raises(PlanError, match=expected[1]):
            PatchPlan.from_json(d)
        return
    q = PatchPlan.from_json(d)
    site = next(s for s in q.sites if s.op == "hub")
    assert site.source == get_op("hub").source(site.keys[0].param_dict)    # re-derived, never the file's
    assert "/elsewhere" not in site.source
    if expected == "loads":
        with apply(q, model) as h:
            assert "model.norm" in h.patched
        return
    with pytest.raises(PlanError, match=expected[1]):
        apply(q, model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_offline_hint_quotes_every_value():
    """The `python -c` command a user is told to copy: every value a literal, whatever the spec said."""
    from patchdsl.ops.hub import download_command

    for rev in ['x";__import__("os").system("touch /tmp/p");"', "$(touch /tmp/p)", "a'b", "`id`"]:
        cmd = download_command({"repo": "org/k", "version": None, "revision": rev})
        argv = shlex.split(cmd)
        assert argv[:2] == ["python", "-c"] and len(argv) == 3
        tree = ast.parse(argv[2])
        call = tree.body[-1].value
        assert isinstance(call, ast.Call) and all(isinstance(a, ast.Constant) for a in call.args)
        assert [k.value.value for k in call.keywords] == [rev]


# ====================================================================== plan files: attention, coverage
ATTENTION_CASES = [
    ("sdpa", None, None),
    ("eager", None, None),
    ("bogus", None, r"unknown attention implementation 'bogus'"),
    ("sdpa; import os", None, r"expected an implementation name"),
    ("flex_attention", None, r"flex_attention cannot run here: needs a CUDA GPU"),
    ("flash_attention_2", None, r"flash_attention_2 cannot run here: needs a CUDA GPU"),
    # with a GPU but no flash-attn package: refused (transformers would fetch a Hub kernel instead)
    ("flash_attention_2", "gpu_no_package", r"needs the flash-attn package"),
]


@pytest.mark.parametrize("impl, setup, error", ATTENTION_CASES, ids=[f"{c[0]}-{c[1]}" for c in ATTENTION_CASES])
def test_attention_of_a_plan_file_is_checked_like_a_spec(impl, setup, error, monkeypatch):
    model = tiny_model("qwen3")
    d = plan("attention sdpa\nmodel.norm: RMSNorm -> fused_rmsnorm\n", model).to_json()
    d["attention"]["impl"] = impl
    if setup == "gpu_no_package":
        from transformers.utils import import_utils

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(import_utils, "is_flash_attn_2_available", lambda: False)
        d["target"] = "cuda"
        from patchdsl.ops.attention_impl import AttentionChoice

        why = AttentionChoice.from_json({"impl": impl, "rule": ""}).unavailable("cuda", type(model))
        assert why and re.search(error, why), why
        return
    if error is None:
        with apply(PatchPlan.from_json(d), model) as h:
            assert h.patched == ["model.norm"]
        return
    with pytest.raises(PlanError, match=error):
        apply(PatchPlan.from_json(d), model)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("strict", [True, False])
def test_a_plan_made_on_two_layers_does_not_silently_patch_two_of_six(strict):
    d = plan("*.input_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n", tiny_model("qwen3")).to_json()
    six = tiny_model("qwen3", num_hidden_layers=6)
    if strict:
        with pytest.raises(PatchError, match=r"does not cover this model: 4 module\(s\).*model\.layers\.2\.input_layernorm"):
            apply(PatchPlan.from_json(d), six, strict=True)
        assert not any("forward" in m.__dict__ for m in six.modules())
        return
    with apply(PatchPlan.from_json(d), six, strict=False) as h:
        assert sorted(r.path for r in h.refused) == [f"model.layers.{i}.input_layernorm" for i in range(2, 6)]
        assert all("not covered by the plan" in r.reason for r in h.refused)


def test_a_liger_site_of_a_plan_file_where_liger_cannot_run_is_a_clear_error():
    d = plan_index(check_spec(parse_spec("dtype fp32\nmodel.norm: RMSNorm -> liger.rms_norm\n")),
                   build_index(tiny_model("qwen3")), target="interpreter").to_json()
    for strict in (True, False):
        with pytest.raises(PlanError, match=r"model\.norm.*cannot be used here"):
            apply(PatchPlan.from_json(d), tiny_model("qwen3"), strict=strict)


# ====================================================================== CLI file arguments
@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hostile")
    f = {}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    f["fifo"] = str(fifo)
    f["zero"] = "/dev/zero"
    f["dir"] = str(tmp_path)
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    f["deep_json"] = str(tmp_path / "deep.json")
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    f["deep_yaml"] = str(tmp_path / "deep.yaml")
    (tmp_path / "laughs.yaml").write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))
    f["laughs_yaml"] = str(tmp_path / "laughs.yaml")
    (tmp_path / "bigint.json").write_text('{"hidden_size": ' + "9" * 5000 + "}")
    f["bigint_json"] = str(tmp_path / "bigint.json")
    (tmp_path / "bad.bin").write_bytes(b'{"rope": tr\xffue}')
    f["nonutf8"] = str(tmp_path / "bad.bin")
    (tmp_path / "bad.kpatch").write_bytes(b"model.norm: RMSNorm -> fused_rmsnorm(eps=1e-6) # \xff\n")
    f["nonutf8_spec"] = str(tmp_path / "bad.kpatch")
    with open(tmp_path / "big.json", "wb") as fh:
        fh.truncate(70 * 1024 * 1024)           # sparse: 70 MB that cost no disk
    f["huge"] = str(tmp_path / "big.json")
    f["longname"] = str(tmp_path / ("n" * 300 + ".kpatch"))
    cfgdir = tmp_path / "cfgfifo"
    cfgdir.mkdir()
    os.mkfifo(cfgdir / "config.json")
    f["config_fifo"] = str(cfgdir)
    return f


def _cfg(tmp_path, name, **over):
    from ..families import tiny_config

    d = tiny_config("llama").to_dict()
    d.update(over)
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(d, allow_nan=True))
    return str(p)


# (argv with {placeholders} from hostile_files / configs, exit code, stderr regex)
CLI_CASES = [
    (["check", "{fifo}"], 2, r"FIFO"),
    (["check", "{zero}"], 2, r"device"),
    (["check", "{dir}"], 2, r"folder"),
    (["check", "{nonutf8_spec}"], 2, r"not UTF-8"),
    (["check", "{nonutf8}"], 2, r"spec files are named NAME\.kpatch"),
    (["check", "{longname}"], 2, r"."),
    (["check", "x" * 5000], 2, r"."),
    (["plan", "qwen3", "--model", "{zero}"], 2, r"."),
    (["plan", "qwen3", "--model", "{fifo}"], 2, r"."),
    (["plan", "qwen3", "--model", "{config_fifo}"], 2, r"FIFO|not a regular file"),
    (["plan", "qwen3", "--model", "{deep_json}"], 2, r"nests deeper"),
    (["plan", "qwen3", "--model", "{bigint_json}"], 2, r"digits"),
    (["plan", "qwen3", "--model", "{nonutf8}"], 2, r"not UTF-8"),
    (["plan", "qwen3", "--model", "m" * 300], 2, r"."),
    (["plan", "llama", "--model", "{cfg_kv}"], 2, r"num_key_value_heads|heads"),
    (["plan", "llama", "--model", "{cfg_theta_nan}"], 2, r"rope_theta"),
    (["plan", "llama", "--model", "{cfg_theta_neg}"], 2, r"rope_theta"),
    (["plan", "llama", "--model", "{cfg_head_dim}"], 2, r"head_dim"),
    (["plan", "llama", "--model", "{cfg_vocab}"], 2, r"vocab_size"),
    (["translate", "--liger", "@{zero}", "--model", "{cfg_ok}"], 2, r"device"),
    (["translate", "--liger", "@{fifo}", "--model", "{cfg_ok}"], 2, r"FIFO"),
    (["translate", "--liger", "@{deep_json}", "--model", "{cfg_ok}"], 2, r"nests deeper"),
    (["translate", "--liger", "@{deep_yaml}", "--model", "{cfg_ok}"], 2, r"nests deeper"),
    (["translate", "--liger", "@{laughs_yaml}", "--model", "{cfg_ok}"], 2, r"alias"),
    (["translate", "--liger", "@{nonutf8}", "--model", "{cfg_ok}"], 2, r"not UTF-8"),
    (["translate", "--liger", "@{huge}", "--model", "{cfg_ok}"], 2, r"too large"),
    (["translate", "--kernel-mapping", "{fifo}", "--model", "{cfg_ok}"], 2, r"FIFO"),
    (["translate", "--kernel-mapping", "{zero}", "--model", "{cfg_ok}"], 2, r"device"),
    (["translate", "--kernel-mapping", "{deep_json}", "--model", "{cfg_ok}"], 2, r"nests deeper"),
    (["verify", "qwen3", "--model", "{cfg_ok}", "--seq", "0"], 2, r"--seq"),
    (["verify", "qwen3", "--model", "{cfg_ok}", "--device", "cuda"], 2, r"--device cuda"),
    (["apply", "qwen3", "--model", "{cfg_ok}", "--device", "cuda:7"], 2, r"--device cuda"),
    (["apply", "qwen3", "--model", "{cfg_ok}", "--json-out", "{fifo}"], 2, r"not a regular file"),
]


@pytest.mark.parametrize("argv, code, message", CLI_CASES, ids=[" ".join(a)[:60] for a, _, _ in CLI_CASES])
def test_hostile_cli_arguments_exit_2_with_a_message(argv, code, message, hostile_files, tmp_path, monkeypatch):
    if "--device" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA machine takes --device cuda")
    subs = dict(hostile_files, cfg_ok=_cfg(tmp_path, "ok"), cfg_kv=_cfg(tmp_path, "kv", num_key_value_heads=3),
                cfg_theta_nan=_cfg(tmp_path, "nan", rope_theta=float("nan"),
                                   rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
                cfg_theta_neg=_cfg(tmp_path, "neg", rope_theta=-1.0,
                                   rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
                cfg_head_dim=_cfg(tmp_path, "hd", head_dim=4096, hidden_size=16384),
                cfg_vocab=_cfg(tmp_path, "vocab", vocab_size=2 ** 31 - 1))
    args = [a.format(**subs) if "{" in a and len(a) < 1000 else a for a in argv]
    with no_hang():
        r = CliRunner().invoke(main, args)
    out = (r.stderr if hasattr(r, "stderr") and r.stderr_bytes is not None else "") + r.output
    assert r.exit_code == code, (r.exit_code, out[-2000:], r.exception)
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    one_line(out)
    assert re.search(message, out), out[-2000:]


# ====================================================================== translate inputs
MAPPINGS = [
    ({"RMSNorm": "kernels-community/liger-kernels:LigerRMSNorm"}, r'hub\("kernels-community/liger-kernels", '
                                                                   r'"LigerRMSNorm", version=1\)'),
    ({"RMSNorm": ["org/k:L", {"version": 2, "trust_remote_code": True}]}, r"version=2, trust_remote_code=true"),
    ({"RMSNorm": ["org/k:L", {"version": 2, "trust_remote_code": False}]}, r'hub\("org/k", "L", version=2\)$'),
    ({"RMSNorm": ["org/k:L", {"version": 2, "trust_remote_code": "false"}]}, "error: trust_remote_code must be true"),
    ({"RMSNorm": ["org/k:L", {"version": "abc"}]}, "error: version must be a whole number"),
    ({"RMSNorm": ["org/k:L", {"version": 1e999}]}, "error: version must be a whole number"),
    ({"RMSNorm": ["org/k:L", {"version": True}]}, "error: version must be a whole number"),
    ({"RMSNorm": ["org/k:L", {"version": 2 ** 40}]}, "error: version must be a whole number"),
    ({"RMSNorm": ["org/k:L", {"revision": 5}]}, "error: revision must be"),
    ({"RMSNorm": ["org/k:L", {"revision": 'a"b'}]}, "error: .*cannot be written in a spec string"),
    ({"RMSNorm": ["org/k:L", {"version": 1, "revision": "main"}]}, "error: give exactly one"),
    ({"RMSNorm": ["org/k:L", {"version": 1, "x": 1}]}, "error: unknown key"),
    ({"RMSNorm": 5}, "error: expected 'org/repo:Layer'"),
    ({"RMSNorm": {"gpu": "org/k:L"}}, "error: unknown device"),
    ({"NoSuchLayer": "org/k:L"}, "error: layer 'NoSuchLayer' is not registered"),
    ([1, 2], "error: a kernel mapping is a JSON object"),
]


@pytest.mark.parametrize("mapping, expected", MAPPINGS, ids=[json.dumps(m)[:70] for m, _ in MAPPINGS])
def test_translate_mapping_values(mapping, expected):
    from patchdsl.interop.translate import MappingError, translate

    model = tiny_model("llama")
    if expected.startswith("error: "):
        with pytest.raises(MappingError, match=expected[len("error: "):]):
            translate(mapping, model)
        return
    rule = [ln for ln in translate(mapping, model).splitlines() if ln.startswith("*:")][0]
    assert re.search(expected, rule.split("#")[0].strip()), rule


# ====================================================================== training arguments
ARGS_CASES = [
    (dict(kpatch_dtype="bf16, fp32"), ["bf16", "fp32"]),
    (dict(kpatch_dtype=["torch.bfloat16", "half"]), ["bf16", "fp16"]),
    (dict(kpatch_dtype={"bf16": 1}), "got dict"),
    (dict(kpatch_dtype=5), "got int"),
    (dict(kpatch_dtype=["bf16", 3]), "each entry is a dtype name"),
    (dict(kpatch_dtype=(d for d in ["bf16"])), "got generator"),
    (dict(kpatch_dtype=["fp64"]), "unknown dtype"),
    (dict(kpatch_log=["sites"]), "kpatch_log must be one of"),
    (dict(kpatch_strict="false"), "kpatch_strict must be true or false"),
    (dict(kpatch_spec=5), "kpatch_spec must be"),
    (dict(kpatch_spec="model.norm: RMSNorm -> fused_rmsnorm(eps=1e309)"), "finite|eps"),
]


def _case_id(value) -> str:
    """A test id that is the same in every process (pytest-xdist compares them): a generator's
    repr carries its address."""
    import re

    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))[:60]


@pytest.mark.parametrize("kw, expected", ARGS_CASES, ids=[_case_id(k) for k, _ in ARGS_CASES])
def test_training_arguments_refuse_what_they_cannot_read(kw, expected):
    from patchdsl import PatchdslArguments

    if isinstance(expected, list):
        assert PatchdslArguments(**kw).kpatch_dtype == expected
        return
    with pytest.raises((ValueError, SpecError), match=expected):
        PatchdslArguments(**kw)


RULE = "model.norm: RMSNorm -> fused_rmsnorm"
CONFIG_CASES = [
    ({"rules": [RULE]}, 1),
    ({"rules": (RULE,), "dtype": ["bf16"]}, 1),
    ({"rules": {RULE: 1}}, "must be a list of strings"),
    ({"rules": (r for r in [RULE])}, "must be a list of strings"),
    ({"rules": []}, "is empty"),
    ({"rules": [RULE + "\n*.mlp: SwiGLU -> fused_swiglu"]}, "line break"),
    ({"rules": [RULE], "dtype": {"bf16": 1}}, "'dtype' must be"),
    ({"rules": [RULE], "dtype": ["bf16\n*.mlp: SwiGLU -> fused_swiglu"]}, "'dtype' must be"),
    ({"rules": [RULE], "strict": "no"}, "'strict' must be true or false"),
    ({"rulez": [RULE]}, "unknown patchdsl config key"),
    ([RULE], "must be a spec path or a mapping"),
]


@pytest.mark.parametrize("config, expected", CONFIG_CASES, ids=[_case_id(c) for c, _ in CONFIG_CASES])
def test_callback_config_refuses_what_it_cannot_read(config, expected):
    from patchdsl.training.trainer import spec_from_config

    if isinstance(expected, int):
        assert len(spec_from_config(config)[0].rules) == expected
        return
    with pytest.raises(SpecError, match=expected):
        spec_from_config(config)


# ====================================================================== flags: bounds, generic
def test_every_integer_flag_of_every_op_has_an_upper_bound():
    unbounded = [f"{n}.{f.name}" for n in ops() for f in get_op(n).flags if f.type == "int" and f.max is None]
    assert not unbounded, f"int flags without an upper bound (checked at `check`): {unbounded}"


def _bound_cases():
    for n in sorted(ops()):
        for f in get_op(n).flags:
            if f.type in ("int", "float") and f.max is not None:
                yield n, f.name, f.max


@pytest.mark.parametrize("op_name, flag, bound", list(_bound_cases()),
                         ids=[f"{o}.{f}" for o, f, _ in _bound_cases()])
def test_a_flag_past_its_bound_is_a_located_error_at_check(op_name, flag, bound):
    from patchdsl.ops.base import FlagTypeError

    spec = get_op(op_name).flag(flag)
    assert spec.coerce(int(bound) if spec.type == "int" else bound) is not None
    over = int(bound) + 1 if spec.type == "int" else (bound * 2 if bound > 0 else bound + 1.0)
    with pytest.raises(FlagTypeError, match=f"must be <= "):
        spec.coerce(over)
    if op_name == "hub" or op_name.startswith("liger."):
        return
    kind = get_op(op_name).kinds[0]
    with pytest.raises(SpecError, match=rf"(?s)1:\d+.*{flag}.*must be <="):
        check_spec(parse_spec(f"x: {kind} -> {op_name}({flag}={over})\n", "b.kpatch"))


# ====================================================================== apply's verdict
@pytest.mark.slow
@pytest.mark.parametrize("rule, code", [
    ("*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm", 0),
    ("*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm(offset=1)", 1),
])
def test_apply_gives_a_parity_verdict_and_exit_code(rule, code, tmp_path):
    spec = tmp_path / "s.kpatch"
    spec.write_text(rule + "\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["apply", str(spec), "--model", _cfg(tmp_path, "ok"), "--steps", "1",
                                  "--device", DEVICE, "--json-out", str(out)])
    assert r.exit_code == code, r.output[-3000:]
    verdict = json.loads(out.read_text())["parity"]
    assert verdict["passed"] is (code == 0)
    assert ("parity: passed" if code == 0 else "parity: FAILED") in r.output
    if code:
        assert "model.norm" in verdict["failed_sites"]


def test_load_spec_with_a_long_name_or_text_is_a_spec_error():
    from patchdsl.syntax import load_spec

    for arg in ["n" * 300 + ".kpatch", "/tmp/" + "d" * 300 + "/x.kpatch", "x" * 5000]:
        with no_hang(), pytest.raises(SpecError) as e:
            load_spec(arg)
        one_line(str(e.value).splitlines()[0])


@pytest.mark.slow
def test_verify_of_a_moe_model_runs_its_float64_reference():
    """transformers' grouped_mm takes no float64: the reference computes the experts eagerly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def moe():
        torch.manual_seed(0)
        cfg = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=160, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")

    r = patchdsl.verify("model.norm: RMSNorm -> fused_rmsnorm\n", moe, dtype="fp32", batch=1, seq=8, device=DEVICE)
    assert r.passed, r.verdict


def test_an_unexpected_exception_is_exit_3_with_one_line_not_a_traceback(monkeypatch):
    """Exit 1 means a failed verification and 2 bad input; a bug of patchdsl is neither."""
    import patchdsl.planning.check as check_mod

    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(check_mod, "check_loaded", boom)
    r = CliRunner().invoke(main, ["check", "qwen3"])
    assert r.exit_code == 3, r.output
    assert "internal error: RuntimeError at test_hostile_inputs.py:" in r.output and "second line" not in r.output
    one_line(r.output)
    monkeypatch.setenv("PATCHDSL_DEBUG", "1")
    r = CliRunner().invoke(main, ["check", "qwen3"])
    assert isinstance(r.exception, RuntimeError)


# ====================================================================== files.py, the one reader
def _files_cases(tmp):
    big = tmp / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(5 * 1024 * 1024)            # sparse: 5 MiB of NULs, over the 1 MiB mapping limit
    fifo = tmp / "f.fifo"
    os.mkfifo(fifo)
    link = tmp / "link.json"
    (tmp / "ok.json").write_text('{"a": [1, 2]}')
    link.symlink_to(tmp / "ok.json")
    (tmp / "bom.json").write_bytes(b'\xef\xbb\xbf{"a": 1}')
    (tmp / "bad.json").write_bytes(b'{"a": 1,}')
    (tmp / "deep.yaml").write_text("- " * 65 + "x\n")
    (tmp / "alias.yaml").write_text("a: &x 1\nb: *x\n")
    (tmp / "bigint.yaml").write_text("a: " + "9" * 65 + "\n")
    (tmp / "ok.yaml").write_text("a: [1, 2]\nb: {c: true}\n")
    (tmp / "latin1.json").write_bytes('{"a": "\u00e9"}'.encode("latin-1"))
    return [
        # (path, kind, expected: a value or a FileReadError reason)
        (tmp / "ok.json", "mapping", {"a": [1, 2]}),
        (link, "mapping", {"a": [1, 2]}),                       # a link to a regular file is read
        (tmp / "bom.json", "mapping", {"a": 1}),
        (tmp / "ok.yaml", "liger", {"a": [1, 2], "b": {"c": True}}),
        (tmp / "missing.json", "mapping", "missing"),
        (tmp, "mapping", "not-regular"),
        (fifo, "mapping", "not-regular"),
        ("/dev/zero", "mapping", "not-regular"),
        ("/dev/null", "mapping", "not-regular"),
        (big, "mapping", "too-large"),
        (tmp / ("n" * 300 + ".json"), "mapping", "os"),
        (str(tmp / "a\0b.json"), "mapping", "os"),
        (tmp / "latin1.json", "mapping", "not-utf8"),
        (tmp / "bad.json", "mapping", "syntax"),
        (tmp / "deep.yaml", "liger", "too-deep"),
        (tmp / "alias.yaml", "liger", "syntax"),
        (tmp / "bigint.yaml", "liger", "big-int"),
    ]


def test_files_reader_table(tmp_path):
    from patchdsl.util.files import FileReadError, read_data

    for path, kind, expected in _files_cases(tmp_path):
        with no_hang(10):
            if not isinstance(expected, str):
                assert read_data(path, kind) == expected, path
                continue
            with pytest.raises(FileReadError) as e:
                read_data(path, kind)
        assert e.value.reason == expected, (str(path)[:80], e.value.reason, str(e.value))
        one_line(str(e.value))
        assert len(str(e.value)) < 400


@pytest.mark.parametrize("text, reason", [
    ("[" * 65 + "]" * 65, "too-deep"),
    ('{"a": ' + "1" * 65 + "}", "big-int"),
    ('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', None),   # in a string
    ('{"a": NaN}', None),
    ("[1,]", "syntax"),
])
def test_parse_json_bounds(text, reason):
    from patchdsl.util.files import FileReadError, parse_json

    if reason is None:
        parse_json(text, "t")
        return
    with pytest.raises(FileReadError) as e:
        parse_json(text, "t")
    assert e.value.reason == reason


def test_plan_file_arguments_of_apply_are_read_as_files(hostile_files, tmp_path):
    """apply(PATH, model): a plan file path (*.json) through files.py, anything else as a spec."""
    fifo_json = tmp_path / "p.json"
    os.mkfifo(fifo_json)
    deep = tmp_path / "deep_plan.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    cases = [
        (str(fifo_json), PlanError, r"FIFO"),
        (str(tmp_path / "missing.json"), PlanError, r"no such file"),
        (str(deep), PlanError, r"nests deeper|nested too deeply"),
        ("/dev/zero", SpecError, r"not a regular file"),
        (hostile_files["dir"], SpecError, r"folder"),
    ]
    for arg, exc, message in cases:
        with no_hang(10), pytest.raises(exc, match=message):
            apply(arg, tiny_model("qwen3"))
        with no_hang(10), pytest.raises(PlanError):
            PatchPlan.load(arg)
