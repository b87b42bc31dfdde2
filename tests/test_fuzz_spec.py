"""Random and mutated spec text never produces anything but a SpecError (no traceback)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchdsl.check import check_spec
from patchdsl.syntax import SpecError, parse_spec
from patchdsl.resources import specs_dir

SEEDS = [
    "dtype bf16, fp32\n*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n",
    "model.layers.{0..3}.mlp, !model.layers.2.mlp: SwiGLU -> fused_swiglu(in_place=false)\n",
    "lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100, chunk=auto)\n",
    "optional *.vision_tower.*: RMSNorm|*Norm -> fused_rmsnorm  # comment\n",
    "default fused_rmsnorm(eps=1e-6)\ninclude \"x.kpatch\"\n",
] + [p.read_text() for p in sorted(specs_dir().glob("*.kpatch"))]

ALPHABET = "abcdefgmlpnorm_.*?{},!:|->()=\"' \n#0123456789eE+-RSLGUNA"


def _run(text: str) -> None:
    try:
        check_spec(parse_spec(text, "fuzz.kpatch"))
    except SpecError as e:
        rendered = e.render()
        assert rendered.startswith("fuzz.kpatch:") or rendered.startswith("error:") or ":" in rendered
        if e.span is not None:
            assert e.span.line >= 1 and e.span.col >= 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=ALPHABET, max_size=120))
def test_random_text(text):
    _run(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.data())
def test_mutated_specs(seed, data):
    text = seed
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["insert", "delete", "replace", "dup"]))
        pos = data.draw(st.integers(0, max(0, len(text))))
        ch = data.draw(st.sampled_from(list(ALPHABET)))
        if op == "insert":
            text = text[:pos] + ch + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + 1:]
        elif op == "replace":
            text = text[:pos] + ch + text[pos + 1:]
        else:
            text = text[:pos] + text[pos:pos + 8] + text[pos:]
    _run(text)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60))
def test_arbitrary_unicode(text):
    _run(text)
