"""Fuzz the spec language: nothing but a SpecError ever comes out, and no case takes over 2 s.

* random and mutated spec text, arbitrary Unicode, and garbled bytes read as a spec file;
* random selectors against random paths, compared with a reference matcher (the previous,
  regex-based implementation: correct, but backtracking, so only fed short inputs).

``deadline=2000`` makes Hypothesis fail any example slower than 2 s.  The examples add up to
over 10,000 per CI run (see ``EXAMPLES``); parsing is cheap, so this takes seconds.
"""

import random
import re
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchdsl.planning.check import check_spec
from patchdsl.util.resources import specs_dir
from patchdsl.syntax import SpecError, parse_spec
from patchdsl.syntax.parser import read_spec
from patchdsl.syntax.selectors import compile_selector

EXAMPLES = {"text": 1200, "mutated": 2500, "unicode": 500, "bytes": 300, "selectors": 5000, "selector_text": 1000}
assert sum(EXAMPLES.values()) >= 10_000

FAST = dict(deadline=2000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SEEDS = [
    "dtype bf16, fp32\n*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm\n",
    "model.layers.{0..3}.mlp, !model.layers.2.mlp: SwiGLU -> fused_swiglu(in_place=false)\n",
    "lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100, chunk=auto, z_loss=1e-4)\n",
    "optional *.vision_tower.*: RMSNorm|*Norm -> fused_rmsnorm  # comment\n",
    "default fused_rmsnorm(eps=1e-6)\ninclude \"x.kpatch\"\n",
    "model.**.{q_norm,k_norm}, \\\n  *.layers.{10..-3}.x: RMSNorm -> fused_rmsnorm(eps=1e309, block=99999999999999999999)\n",
] + [p.read_text() for p in sorted(specs_dir().glob("*.kpatch"))]

ALPHABET = "abcdefgmlpnorm_.*?{},!:|->()=\"' \n#0123456789eE+-RSLGUNA\\"


def _check_error(e: SpecError) -> None:
    rendered = e.render()
    assert rendered and "Traceback" not in rendered
    assert 1 <= len(e.errors) <= 20
    for one in e.errors:
        if one.span is not None:
            assert one.span.line >= 1 and one.span.col >= 1
            assert rendered.count(f"{one.span.file}:{one.span.line}:{one.span.col}: error:") >= 1


def _run(text: str) -> None:
    try:
        check_spec(parse_spec(text, "fuzz.kpatch"))
    except SpecError as e:
        _check_error(e)


@settings(max_examples=EXAMPLES["text"], **FAST)
@given(st.text(alphabet=ALPHABET, max_size=120))
def test_random_text(text):
    _run(text)


@settings(max_examples=EXAMPLES["mutated"], **FAST)
@given(st.sampled_from(SEEDS), st.integers(0, 2**32 - 1))
def test_mutated_specs(seed, n):
    # The mutations come from a seeded Random: drawing each from Hypothesis costs more than the parse.
    rnd = random.Random(n)
    text = seed
    for _ in range(rnd.randint(1, 4)):
        op = rnd.choice(["insert", "delete", "replace", "dup"])
        pos = rnd.randint(0, max(0, len(text)))
        ch = rnd.choice(ALPHABET)
        if op == "insert":
            text = text[:pos] + ch + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + 1:]
        elif op == "replace":
            text = text[:pos] + ch + text[pos + 1:]
        else:
            text = text[:pos] + text[pos:pos + 8] + text[pos:]
    _run(text)


@settings(max_examples=EXAMPLES["unicode"], **FAST)
@given(st.text(max_size=80))
def test_arbitrary_unicode(text):
    _run(text)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "garbled.kpatch"


@settings(max_examples=EXAMPLES["bytes"], **FAST)
@given(st.sampled_from(SEEDS), st.binary(max_size=24), st.integers(0, 400))
def test_garbled_bytes_file(scratch, seed, junk, pos):
    """Bytes spliced into a spec file (invalid UTF-8, NULs, control characters)."""
    data = seed.encode()
    data = data[:pos] + junk + data[pos:]
    scratch.write_bytes(data)
    try:
        check_spec(read_spec(scratch))
    except SpecError as e:
        _check_error(e)
        if "is not a spec" in e.message:          # refused as a whole: nothing of it is shown
            assert len(e.errors) == 1 and e.span.source_line == ""
            assert _not_text(data)
    else:
        assert not _not_text(data)


def _not_text(b: bytes) -> bool:
    try:
        text = b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return any(ord(c) < 32 and c not in "\t\n\r\f" for c in text)


# ---------------------------------------------------------------------------- selectors
# The reference: the previous regex-based compiler (backtracking, so short inputs only).
from patchdsl.syntax.ast import Span  # noqa: E402

_RANGE = re.compile(r"^\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")
MAX_RANGE = 100_000


def _ref_err(msg, span, offset=0, width=1, hint=None):
    if span is not None:
        span = Span(span.file, span.line, span.col + offset, span.col + offset + width, span.source_line)
    return SpecError(msg, span, hint=hint)


def _glob_body(text: str, span: Span | None, base: int) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "*":
            out.append(".*")
            while i + 1 < len(text) and text[i + 1] == "*":
                i += 1
        elif c == "?":
            out.append("[^.]")
        elif c == "{":
            depth, j = 1, i + 1
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise _ref_err("unclosed '{' in selector", span, base + i,
                           hint="alternation is written {a,b}, a range {0..11}")
            inner = text[i + 1:j - 1]
            out.append(_brace(inner, span, base + i + 1))
            i = j - 1
        elif c == "}":
            raise _ref_err("unexpected '}' in selector", span, base + i, hint="expected '{' before it")
        elif c == ",":
            raise _ref_err("',' outside braces in selector", span, base + i)
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _split_top(inner: str) -> list[tuple[str, int]]:
    parts, depth, start = [], 0, 0
    for k, c in enumerate(inner):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append((inner[start:k], start))
            start = k + 1
    parts.append((inner[start:], start))
    return parts


def _brace(inner: str, span: Span | None, base: int) -> str:
    m = _RANGE.match(inner)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo > hi:
            raise _ref_err(f"empty range {{{lo}..{hi}}}: the first number must not exceed the second",
                       span, base - 1, len(inner) + 2)
        if hi - lo > MAX_RANGE:
            raise _ref_err(f"range {{{lo}..{hi}}} is too large (at most {MAX_RANGE} values)", span, base - 1,
                       len(inner) + 2)
        return "(?:" + "|".join(str(n) for n in range(hi, lo - 1, -1)) + ")"
    if ".." in inner and "," not in inner:
        raise _ref_err(f"bad range {{{inner}}}", span, base - 1, len(inner) + 2,
                   hint="a range is two integers, e.g. {0..11}")
    parts = _split_top(inner)
    if any(not p.strip() for p, _ in parts):
        raise _ref_err("empty alternative in {...}", span, base - 1, len(inner) + 2,
                   hint="write alternatives as {q_norm,k_norm}")
    return "(?:" + "|".join(_glob_body(p.strip(), span, base + off) for p, off in parts) + ")"


def _ref_selector_regex(text: str, span: Span | None = None) -> str:
    """Return the anchored regex source for a selector (without the ``!``)."""
    if not text:
        raise _ref_err("empty selector", span)
    comps = _split_components(text)
    pieces: list[str] = []
    pos = 0
    n = len(comps)
    for idx, comp in enumerate(comps):
        if comp == "**":
            if n == 1:
                pieces.append(".*")
            elif idx == 0:
                pieces.append(r"(?:[^.]+\.)*")
            elif idx == n - 1:
                pieces.append(r"(?:\.[^.]+)*")
            else:
                pieces.append(r"(?:\.[^.]+)*\.")
        else:
            if "**" in comp:
                raise _ref_err("'**' must be a whole path component (e.g. model.**.mlp)", span,
                           pos + comp.index("**"), 2, hint="use '*' inside a name")
            if comp == "":
                raise _ref_err("empty path component in selector", span, pos,
                           hint="module paths look like model.layers.0.mlp")
            prefix = ""
            if idx > 0 and comps[idx - 1] != "**":
                prefix = r"\."
            pieces.append(prefix + _glob_body(comp, span, pos))
        pos += len(comp) + 1
    return "".join(pieces)


def _split_components(text: str) -> list[str]:
    comps, depth, start = [], 0, 0
    for k, c in enumerate(text):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "." and depth == 0:
            # '..' inside braces is a range; at top level it is an empty component
            comps.append(text[start:k])
            start = k + 1
    comps.append(text[start:])
    return comps



@lru_cache(maxsize=None)
def reference(text: str):
    return re.compile(r"\A(?:" + _ref_selector_regex(text) + r")\Z")


PIECES = ["a", "b", "ab", "*", "?", "a*", "*b", "?a", "{a,b}", "{a*,?b}", "{0..12}", "{2..3}", "{-2..1}", "1",
          "{a,{b,ab}}", "x{0..9}y", "{ab,a}b", "**", "*?", "?*"]
PATH_PARTS = ["a", "b", "ab", "ba", "aab", "0", "1", "12", "3", "-1", "x5y", "ab1", "bb"]


def random_selector(rnd: random.Random) -> str:
    return ".".join("".join(rnd.choice(PIECES) for _ in range(rnd.randint(1, 3))) for _ in range(rnd.randint(1, 4)))


def random_path(rnd: random.Random) -> str:
    return ".".join(rnd.choice(PATH_PARTS) for _ in range(rnd.randint(1, 5)))


paths = st.lists(st.sampled_from(PATH_PARTS), min_size=1, max_size=5).map(".".join)


def _outcome(fn):
    try:
        return fn()
    except SpecError:
        return "error"


@settings(max_examples=EXAMPLES["selectors"], **FAST)
@given(st.integers(0, 2**32 - 1))
def test_selectors_match_the_reference(n):
    # One seeded Random per example (cheap to draw); the failing seed is what Hypothesis reports.
    rnd = random.Random(n)
    sel = random_selector(rnd)
    ps = [random_path(rnd) for _ in range(6)]
    got = _outcome(lambda: compile_selector(sel))
    want = _outcome(lambda: reference(sel))
    assert (got == "error") == (want == "error"), sel
    if got == "error":
        return
    for p in ps:
        assert got.match(p) == bool(want.match(p)), (sel, p)


@settings(max_examples=EXAMPLES["selector_text"], **FAST)
@given(st.text(alphabet="ab.*?{},0123456789-", max_size=14), paths)
def test_random_selector_text(sel, path):
    """Any string: a SpecError or a matcher that agrees with the reference."""
    try:
        m = compile_selector(sel)
    except SpecError as e:
        _check_error(e)
        return
    assert m.match(path) == bool(reference(sel).match(path)), (sel, path)
