"""External kernels (issue 14): Hub kernel layers through the `kernels` library, Liger-Kernel ops,
KernelConfig mappings translated into specs, and the attention directive.

Offline and on the CPU: Hub-style kernel repositories are written into tmp_path and loaded with the
kernels library's local-repository support (HF_HUB_OFFLINE=1 is set by conftest); Liger-Kernel needs
a GPU, so on the CPU its sites are refused at plan time and the GPU test verifies them.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import patchdsl
from patchdsl.planning.check import check_spec
from patchdsl.planning.plan import PatchPlan
from patchdsl.ops.hub import write_kernel_repo
from patchdsl.syntax import SpecError, parse_spec
from tests.kernels.helpers import DEVICE, ON_GPU
from tests.parity.test_verify import tiny_qwen3

kernels = pytest.importorskip("kernels")      # in the `test` extra; skipped only where it is absent

RMS_LAYER = textwrap.dedent('''
    import torch

    class TinyRMSNorm(torch.nn.Module):
        """Qwen3RMSNorm's forward, {note}."""

        def forward(self, hidden_states):
            dt = hidden_states.dtype
            x = hidden_states.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * x.to(dt) * {scale}
''')


def norm_repo(root, err: float = 0.0):
    """A Hub-style repository whose TinyRMSNorm is right (err=0) or off by a relative ``err``."""
    note = "exact" if err == 0 else f"with a deliberate relative error of {err:g}"
    return write_kernel_repo(root, "tiny-norm", RMS_LAYER.format(note=note, scale=repr(1.0 + err)))


def hub_spec(repo, selectors="*.input_layernorm, model.norm") -> str:
    return f'{selectors}: RMSNorm -> hub("{repo}", "TinyRMSNorm")\n*.mlp: SwiGLU -> fused_swiglu\n'


# ---------------------------------------------------------------- the language
@pytest.mark.parametrize("text, op, args, flags", [
    ('m: RMSNorm -> hub("org/repo", "L", version=1)\n', "hub", ("org/repo", "L"), {"version": 1}),
    ('m: RMSNorm -> hub("org/repo", "L", revision="abc")\n', "hub", ("org/repo", "L"), {"revision": "abc"}),
    ('m: RMSNorm -> hub(repo="org/repo", layer="L", version=2)\n', "hub", (), {"repo": "org/repo", "layer": "L", "version": 2}),
    ("*.mlp: SwiGLU -> liger.swiglu\n", "liger.swiglu", (), {}),
    ("m: RMSNorm -> liger.rms_norm(eps=1e-5)\n", "liger.rms_norm", (), {"eps": 1e-5}),
])
def test_external_op_syntax(text, op, args, flags):
    call = parse_spec(text).rules[0].op
    assert (call.name, tuple(a.value for a in call.args), {f.name: f.value for f in call.flags}) == (op, args, flags)


@pytest.mark.parametrize("text, message", [
    ('m: RMSNorm -> hub(version=1, "org/repo")\n', "a positional value after a flag"),
    ('m: RMSNorm -> fused_rmsnorm("x")\n', "fused_rmsnorm takes no positional values"),
    ('m: RMSNorm -> hub("a/b", "L", "extra")\n', "hub takes at most 2 positional value(s)"),
    ('m: RMSNorm -> liger.rms_nrom\n', "unknown op 'liger.rms_nrom'"),
    ("attention sdpa\nattention eager\n", "'attention' given twice"),
])
def test_external_op_syntax_errors(text, message):
    with pytest.raises(SpecError) as e:
        check_spec(parse_spec(text, "t.kpatch"))
    assert message in str(e.value) and "t.kpatch:" in str(e.value)


@pytest.mark.parametrize("call, message", [
    ('hub("org/repo", "L")', "needs a pin: version=N"),
    ('hub("org/repo", "L", version=1, revision="x")', "not both"),
    ('hub("noslash", "L", version=1)', "not a Hub repository id"),
    ('hub("./here", "L", version=1)', "its files are the pin"),
])
def test_hub_pins_are_checked_at_plan_time(call, message):
    model = tiny_qwen3(layers=1)()
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec(f"model.norm: RMSNorm -> {call}\n", "p.kpatch"), model)
    assert message in str(e.value) and "p.kpatch:1" in str(e.value) and "model.norm" in str(e.value)


# ---------------------------------------------------------------- Hub kernels from a local repository
def test_hub_layer_plans_applies_and_undoes(tmp_path):
    repo = norm_repo(tmp_path / "good")
    model = tiny_qwen3(layers=2)()
    p = patchdsl.plan(parse_spec(hub_spec(repo)), model, dtypes=("fp32",))
    hub_sites = [s for s in p.sites if s.op == "hub"]
    assert [s.path for s in hub_sites] == ["model.layers.0.input_layernorm", "model.layers.1.input_layernorm", "model.norm"]
    from patchdsl.ops.hub import repo_digest

    digest = repo_digest(repo)           # the pin of a local repository: the hash of all its files
    assert all(s.flag_dict["sha256"] == digest and s.source == f"local {repo} layer TinyRMSNorm (sha256 {digest[:16]})"
               for s in hub_sites)
    assert p.kernel_keys() and all(k.op == "fused_swiglu" for k in p.kernel_keys())   # nothing generated for hub
    assert PatchPlan.from_json(p.to_json()).sites == p.sites
    other = tiny_qwen3(layers=2)()
    with patchdsl.apply(p, model) as h:
        assert "model.norm" in h.patched
        assert model.model.norm.forward.__func__.__qualname__ == "TinyRMSNorm.forward"
        assert "forward" not in other.model.norm.__dict__          # per instance: the class is untouched
    assert "forward" not in model.model.norm.__dict__               # undo restores exactly


def test_hub_relative_path_is_relative_to_the_spec_file(tmp_path):
    norm_repo(tmp_path / "vendor" / "tiny")
    spec_file = tmp_path / "s.kpatch"
    spec_file.write_text('model.norm: RMSNorm -> hub("./vendor/tiny", "TinyRMSNorm")\n')
    p = patchdsl.plan(patchdsl.load_spec(spec_file), tiny_qwen3(layers=1)())
    assert p.site("model.norm").source.startswith(f"local {(tmp_path / 'vendor' / 'tiny').resolve()} layer TinyRMSNorm")


def test_verify_passes_for_a_correct_hub_layer_and_names_the_wrong_one(tmp_path):
    good = patchdsl.verify(hub_spec(norm_repo(tmp_path / "good")), tiny_qwen3(layers=1), dtype="fp32", batch=1, seq=8,
                           device=DEVICE)
    assert good.passed, good.verdict
    assert {s["path"] for s in good.sites if s["op"] == "hub"} == {"model.layers.0.input_layernorm", "model.norm"}
    bad = patchdsl.verify(hub_spec(norm_repo(tmp_path / "bad", err=1e-2)), tiny_qwen3(layers=1), dtype="fp32",
                          batch=1, seq=8, device=DEVICE)
    assert not bad.passed
    assert set(bad.failed_sites()) == {"model.layers.0.input_layernorm", "model.norm"}   # the MLP site still passes
    assert "model.norm (hub)" in bad.verdict
    assert bad.to_json()["sites"][0]["source"].startswith("local ")


def test_verify_bf16_hub_layer_same_tolerances(tmp_path):
    report = patchdsl.verify(hub_spec(norm_repo(tmp_path / "good"), "model.norm"), tiny_qwen3(layers=1),
                             dtype="bf16", batch=1, seq=8, device=DEVICE)
    assert report.passed, report.verdict
    # in bf16 a relative error of 1e-2 is within rounding (the bound is 4x HF's own bf16 error, about
    # 1e-2 here); 5e-2 is not
    bad = patchdsl.verify(hub_spec(norm_repo(tmp_path / "bad", err=5e-2), "model.norm"), tiny_qwen3(layers=1),
                          dtype="bf16", batch=1, seq=8, device=DEVICE)
    assert bad.failed_sites() == ["model.norm"]


@pytest.mark.parametrize("setup, message", [
    ("missing", "cannot load layer 'TinyRMSNorm' from the local repository"),
    ("no_layer", "has no layer 'TinyRMSNorm' (its layers: OtherNorm)"),
    ("empty", "build/torch-universal/metadata.json"),
    ("no_backward", "declares has_backward=False"),
])
def test_unavailable_local_repository_names_the_site_and_where_to_put_files(tmp_path, setup, message):
    repo = tmp_path / "r"
    if setup == "no_layer":
        write_kernel_repo(repo, "other-norm", "import torch\nclass OtherNorm(torch.nn.Module):\n    pass\n")
    elif setup == "empty":
        repo.mkdir()
    elif setup == "no_backward":
        write_kernel_repo(repo, "fwd-norm", "import torch\nclass TinyRMSNorm(torch.nn.Module):\n    has_backward = False\n"
                          "    def forward(self, hidden_states):\n        return hidden_states\n")
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec(f'model.norm: RMSNorm -> hub("{repo}", "TinyRMSNorm")\n', "u.kpatch"),
                      tiny_qwen3(layers=1)())
    text = str(e.value)
    assert "u.kpatch:1" in text and "model.norm:" in text and message in text


def test_hub_id_not_in_the_offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))        # an empty cache: nothing may be downloaded
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec('model.norm: RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", '
                                 'version=1)\n', "o.kpatch"), tiny_qwen3(layers=1)())
    text = str(e.value)
    assert "model.norm" in text and "HF_HUB_OFFLINE" in text and "get_kernel(\"kernels-community/liger-kernels\", version=1)" in text
    assert 'hub("./folder", "LigerRMSNorm")' in text


def test_missing_kernels_package_says_what_to_install(tmp_path, monkeypatch):
    import patchdsl.ops.hub as hub

    def missing():
        raise ImportError("no kernels")

    monkeypatch.setattr(hub, "kernels_library", missing)
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec(hub_spec(norm_repo(tmp_path / "g"), "model.norm"), "k.kpatch"), tiny_qwen3(layers=1)())
    assert "model.norm" in str(e.value) and "pip install 'patchdsl[hub]'" in str(e.value)


def test_hub_layer_with_a_mismatched_forward_is_refused(tmp_path):
    repo = write_kernel_repo(tmp_path / "sig", "sig-norm", textwrap.dedent('''
        import torch
        class TinyRMSNorm(torch.nn.Module):
            def forward(self, hidden_states, residual):
                return hidden_states
    '''))
    model = tiny_qwen3(layers=1)()
    h = patchdsl.apply(f'model.norm: RMSNorm -> hub("{repo}", "TinyRMSNorm")\n', model)
    assert h.patched == [] and "does not match" in h.refused[0].reason
    h.undo()


# ---------------------------------------------------------------- Liger-Kernel
LIGER_SPEC = ("*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> liger.rms_norm\n"
              "*.mlp: SwiGLU -> liger.swiglu\n")


@pytest.mark.skipif(ON_GPU, reason="the CPU refusal")
def test_liger_on_the_interpreter_is_refused_at_plan_time():
    pytest.importorskip("liger_kernel")
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec(LIGER_SPEC, "l.kpatch"), tiny_qwen3(layers=1)(), target="interpreter")
    text = str(e.value)
    assert "l.kpatch:1" in text and "model.layers.0.input_layernorm" in text
    assert "need a CUDA GPU" in text and "--target cuda" in text


def test_liger_plans_for_cuda_anywhere():
    pytest.importorskip("liger_kernel")
    p = patchdsl.plan(parse_spec(LIGER_SPEC), tiny_qwen3(layers=1)(), target="cuda")
    assert {s.op for s in p.sites} == {"liger.rms_norm", "liger.swiglu"}
    assert all(s.source.startswith("liger-kernel ") for s in p.sites)
    assert p.kernel_keys() == []


def test_liger_missing_package_message(monkeypatch):
    import patchdsl.ops.liger as liger

    def missing():
        raise ImportError("No module named 'liger_kernel'")

    monkeypatch.setattr(liger, "_functional", missing)
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec("*.mlp: SwiGLU -> liger.swiglu\n"), tiny_qwen3(layers=1)(), target="cuda")
    assert "model.layers.0.mlp" in str(e.value) and "pip install liger-kernel" in str(e.value)


class ReferenceLiger:
    """liger_kernel.transformers.functional's signatures and layouts, computed in plain torch: the
    Liger adapters (argument order, (batch, heads, seq, dim) RoPE layout, loss reductions) are
    checked on the CPU against it; ``rope_bug`` rotates the wrong way."""

    def __init__(self, rope_bug=False):
        self.bug = rope_bug

    def liger_rms_norm(self, X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        x = X.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (W + offset) * y.to(X.dtype) if casting_mode == "llama" else (y * (W.float() + offset)).to(X.dtype)

    def liger_swiglu(self, a, b):
        return torch.nn.functional.silu(a) * b

    def liger_rope(self, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        if self.bug:
            sin = -sin          # rotates the wrong way
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def liger_cross_entropy(self, input, target, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                            lse_square_scale=0.0, **kw):
        return torch.nn.functional.cross_entropy(input.float(), target, ignore_index=ignore_index,
                                                 reduction=reduction, label_smoothing=label_smoothing)

    def liger_fused_linear_cross_entropy(self, input, weight, target, bias=None, ignore_index=-100,
                                         reduction="mean", softcap=None, **kw):
        logits = torch.nn.functional.linear(input, weight, bias).float()
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


@pytest.mark.parametrize("rope_bug", [False, True])
def test_liger_adapters_against_a_reference_functional(monkeypatch, rope_bug):
    import patchdsl.ops.liger as liger

    monkeypatch.setattr(liger, "_functional", lambda: ReferenceLiger(rope_bug))
    monkeypatch.setattr(liger.LigerOp, "unavailable", lambda self, params: None)     # runs on the CPU here
    if rope_bug:
        report = patchdsl.verify("*.self_attn: Attention -> liger.rope\n", tiny_qwen3(layers=1), dtype="fp32",
                                 batch=1, seq=8, device=DEVICE)
        assert report.failed_sites() == ["model.layers.0.self_attn"]
        return
    spec = LIGER_SPEC + ("*.self_attn: Attention -> liger.rope\n"
                         "lm_head: Linear -> liger.fused_linear_cross_entropy\n")
    report = patchdsl.verify(spec, tiny_qwen3(layers=1), dtype="fp32", batch=2, seq=8, device=DEVICE)
    assert report.passed, report.verdict
    assert len(report.sites) == 6
    ce = patchdsl.verify("lm_head: Linear -> liger.cross_entropy\n", tiny_qwen3(layers=1), dtype="fp32", batch=2,
                         seq=8, device=DEVICE)
    assert ce.passed, ce.verdict


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Liger-Kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_liger_ops_verify_on_gpu(dtype):
    pytest.importorskip("liger_kernel")
    spec = LIGER_SPEC + "*.self_attn: Attention -> liger.rope\nlm_head: Linear -> liger.fused_linear_cross_entropy\n"
    report = patchdsl.verify(spec, tiny_qwen3(layers=2), dtype=dtype, batch=2, seq=16, device="cuda")
    assert report.passed, report.verdict
    assert {s["op"] for s in report.sites} == {"liger.rms_norm", "liger.swiglu", "liger.rope",
                                              "liger.fused_linear_cross_entropy"}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="Liger-Kernel needs a CUDA GPU")
def test_mixed_generated_liger_and_hub_spec_verifies_on_gpu(tmp_path):
    """The H200 closing check at tiny sizes: generated ops, a Liger op and a local Hub-style kernel."""
    pytest.importorskip("liger_kernel")
    repo = write_kernel_repo(tmp_path / "norm", "gpu-norm", RMS_LAYER.format(note="exact", scale="1.0"), backend="cuda")
    spec = (f'*.input_layernorm, *.post_attention_layernorm: RMSNorm -> hub("{repo}", "TinyRMSNorm")\n'
            "model.norm: RMSNorm -> fused_rmsnorm\n*.self_attn: Attention -> fused_qk_norm_rope\n"
            "*.mlp: SwiGLU -> liger.swiglu\nlm_head: Linear -> fused_linear_cross_entropy\n")
    report = patchdsl.verify(spec, tiny_qwen3(layers=2), dtype="bf16", batch=2, seq=32, steps=1, device="cuda")
    assert report.passed, report.verdict
    assert {s["op"] for s in report.sites} == {"hub", "fused_rmsnorm", "fused_qk_norm_rope", "liger.swiglu",
                                              "fused_linear_cross_entropy"}


def test_plan_cli_shows_sources_and_check_needs_no_kernel(tmp_path):
    from click.testing import CliRunner

    from patchdsl.cli import main

    repo = norm_repo(tmp_path / "good")
    spec = tmp_path / "s.kpatch"
    spec.write_text(f'attention eager\nmodel.norm: RMSNorm -> hub("{repo}", "TinyRMSNorm")\n')
    r = CliRunner().invoke(main, ["plan", str(spec), "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 0, r.output
    assert "local " in r.output and "TinyRMSNorm" in r.output and "sha256" in r.output
    assert "attention implementation: eager" in r.output and "1 site(s) with external kernels" in r.output
    spec.write_text('model.norm: RMSNorm -> hub("./not/there", "X")\n')
    assert CliRunner().invoke(main, ["check", str(spec)]).exit_code == 0          # no model, nothing loaded
    r = CliRunner().invoke(main, ["plan", str(spec), "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 2 and "model.norm" in r.output and "build/torch-universal" in r.output


# ---------------------------------------------------------------- KernelConfig mappings
def _meta_qwen3():
    with torch.device("meta"):
        return tiny_qwen3(layers=2)()


@pytest.mark.parametrize("value, device, rule", [
    ("org/norms:LigerRMSNorm", "cuda", '*: Qwen3RMSNorm -> hub("org/norms", "LigerRMSNorm", version=1)'),
    ({"cuda": "org/norms:A", "rocm": "org/rocm-norms:B"}, "rocm", '*: Qwen3RMSNorm -> hub("org/rocm-norms", "B", version=1)'),
    (["org/norms:A", {"version": 3}], "cuda", '*: Qwen3RMSNorm -> hub("org/norms", "A", version=3)'),
    (["org/norms:A", {"revision": "v1.2", "trust_remote_code": True}], "cuda",
     '*: Qwen3RMSNorm -> hub("org/norms", "A", revision="v1.2", trust_remote_code=true)'),
    ({"cuda": ["org/norms:A", {"revision": "abc"}]}, "cuda", '*: Qwen3RMSNorm -> hub("org/norms", "A", revision="abc")'),
    ("/abs/repo:A", "cuda", '*: Qwen3RMSNorm -> hub("/abs/repo", "A")'),
    ("./vendor/repo:A", "cuda", '*: Qwen3RMSNorm -> hub("./vendor/repo", "A")'),
    ({"rocm": "org/norms:A"}, "cuda", "# RMSNorm: no entry for cuda; kernelize keeps the original forward"),
])
def test_each_mapping_value_form_translates(value, device, rule):
    from patchdsl.interop.translate import translate

    text = translate({"RMSNorm": value}, _meta_qwen3(), device=device)
    assert rule in text
    parse_spec(text)       # the output is a spec


@pytest.mark.parametrize("mapping, message", [
    ({"NoSuchLayer": "org/x:Y"}, "layer 'NoSuchLayer' is not registered in Qwen3ForCausalLM"),
    ({"RMSNorm": "no-colon"}, "expected 'org/repo:Layer'"),
    ({"RMSNorm": ["org/x:Y", {"version": 1, "revision": "a"}]}, "exactly one of version and revision"),
    ({"RMSNorm": {"gpu": "org/x:Y"}}, "unknown device 'gpu'"),
])
def test_bad_mappings_are_errors(mapping, message):
    from patchdsl.interop.translate import MappingError, translate

    with pytest.raises(MappingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        translate(mapping, _meta_qwen3())


def test_function_kernels_are_listed_not_translated():
    from patchdsl.interop.translate import translate

    text = translate({"rotary_pos_emb": "org/rope:apply"}, _meta_qwen3())
    assert "# rotary_pos_emb: a function kernel" in text and "->" not in text


def test_translated_spec_patches_what_kernelize_replaces(tmp_path):
    """The kernels library's own kernelize, given transformers' layer names, against our plan."""
    from kernels import LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping

    from patchdsl.interop.translate import layer_names, translate

    repo = norm_repo(tmp_path / "good")
    model = tiny_qwen3(layers=2)()
    names = layer_names(model)
    assert names["model.layers.0.self_attn.q_norm"] == ("Qwen3RMSNorm", "RMSNorm")
    text = translate({"RMSNorm": f"{repo}:TinyRMSNorm"}, model)
    p = patchdsl.plan(parse_spec(text), model)
    planned = {s.path for s in p.sites}
    # what kernelize does once the classes carry transformers' layer names (transformers sets them
    # when its kernels integration is active; it is not with this kernels version, so set them here)
    classes = {type(m) for path, m in model.named_modules() if path in names}
    attrs = ("kernel_layer_name", "kernel_condition")
    missing = object()
    saved = {(c, a): c.__dict__.get(a, missing) for c in classes for a in attrs}
    kz = tiny_qwen3(layers=2)()
    try:
        for c in classes:
            replace_kernel_forward_from_hub(c, names_by_class(names)[c.__name__])
        mapping = {"RMSNorm": {"cpu": {Mode.FALLBACK: LocalLayerRepository(repo_path=repo, layer_name="TinyRMSNorm")}}}
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(kz, mode=Mode.TRAINING, device="cpu")
    finally:
        for (c, a), old in saved.items():      # the classes exactly as they were
            if old is missing:
                if a in c.__dict__:
                    delattr(c, a)
            else:
                setattr(c, a, old)
    replaced = {path for path, m in kz.named_modules() if "forward" in m.__dict__
                and m.forward.__func__.__qualname__ == "TinyRMSNorm.forward"}
    assert planned == replaced and len(planned) == 2 * 4 + 1     # 4 norms per layer (q_norm, k_norm too) + model.norm


def names_by_class(names):
    return {cls: lname for cls, lname in names.values()}


def test_translate_cli(tmp_path):
    import json

    from click.testing import CliRunner

    from patchdsl.cli import main

    f = tmp_path / "mapping.json"
    f.write_text(json.dumps({"kernel_mapping": {"RMSNorm": {"cuda": "kernels-community/liger-kernels:LigerRMSNorm"}}}))
    r = CliRunner().invoke(main, ["translate", "--kernel-mapping", str(f), "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 0, r.output
    assert '*: Qwen3RMSNorm -> hub("kernels-community/liger-kernels", "LigerRMSNorm", version=1)' in r.output
    f.write_text("{not json")
    r = CliRunner().invoke(main, ["translate", "--kernel-mapping", str(f), "--model", "Qwen/Qwen3-0.6B"])
    assert r.exit_code == 2 and "cannot read" in r.output


# ---------------------------------------------------------------- the attention directive
def test_attention_directive_is_per_instance_and_undone():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registry = dict(ALL_ATTENTION_FUNCTIONS._global_mapping)
    a = tiny_qwen3(layers=1)()
    b = type(a)(a.config)                  # another instance sharing the very same config object
    assert b.config is a.config and a.config._attn_implementation == "sdpa"
    p = patchdsl.plan(parse_spec("attention eager\nmodel.norm: RMSNorm -> fused_rmsnorm\n"), a)
    assert p.attention.impl == "eager" and PatchPlan.from_json(p.to_json()).attention == p.attention
    cfg = a.config
    seen = []
    with patchdsl.apply(p, a):
        assert a.model.layers[0].self_attn.config._attn_implementation == "eager"
        assert a.config._attn_implementation == "eager" and a.model.config is a.config
        assert b.config._attn_implementation == "sdpa" and b.model.layers[0].self_attn.config is cfg
        import transformers.models.qwen3.modeling_qwen3 as mq

        orig = mq.eager_attention_forward
        mq.eager_attention_forward = lambda *x, **k: (seen.append(1), orig(*x, **k))[1]
        try:
            a(input_ids=torch.tensor([[1, 2, 3]]))
            n_a = len(seen)
            b(input_ids=torch.tensor([[1, 2, 3]]))
        finally:
            mq.eager_attention_forward = orig
        assert n_a == 1 and len(seen) == 1          # a ran eager attention, b did not
    assert a.config is cfg and a.model.layers[0].self_attn.config is cfg and cfg._attn_implementation == "sdpa"
    assert dict(ALL_ATTENTION_FUNCTIONS._global_mapping) == registry


def test_verify_covers_the_attention_implementation():
    report = patchdsl.verify("attention eager\n*.mlp: SwiGLU -> fused_swiglu\n", tiny_qwen3(layers=1), dtype="fp32",
                             batch=1, seq=8, device=DEVICE)
    assert report.passed, report.verdict
    assert report.attention == "eager" and report.to_json()["attention"] == "eager"


@pytest.mark.parametrize("text, message", [
    ("attention flash_attention_2\n", "flash-attn"),
    ("attention flex_attention\n", "no backward on the CPU"),
    ("attention sdpaa\n", "did you mean 'sdpa'"),
    ('attention "kernels-community/flash-attn3"\n', "Hub attention kernels"),
])
def test_unavailable_attention_is_rejected_at_plan_time(text, message):
    if ON_GPU and "flex_attention" in text:
        pytest.skip("flex_attention trains on the GPU")
    if ON_GPU and "flash_attention_2" in text:
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            pytest.skip("flash-attn is installed here")
    with pytest.raises(SpecError) as e:
        patchdsl.plan(parse_spec(text + "model.norm: RMSNorm -> fused_rmsnorm\n", "a.kpatch"), tiny_qwen3(layers=1)())
    assert "a.kpatch:1" in str(e.value) and message in str(e.value)
    if "flash_attention_2" in text and not ON_GPU:
        assert "a CUDA GPU" in str(e.value)
