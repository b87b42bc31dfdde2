"""patchdsl.kernel_support.launch: the fast kernel launch and when it must fall back to the normal one.

On the CPU: the specialisation key against Triton's own ``native_specialize_impl`` (a table of
arguments), the refusal decisions, and the launcher's cache driven through a fake JIT function
whose "compiler" keys its kernels by Triton's real specialisation, so every launch can be checked
to have run the kernel Triton would have picked.  The GPU tests at the end compare the fast and
the normal launch of generated kernels bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from patchdsl.kernel_support import launch as L

native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
from triton.backends.compiler import BaseBackend  # noqa: E402


def triton_spec(a):
    """Triton's specialisation of one runtime argument (what its cache key holds)."""
    return tuple(native(BaseBackend, a, False, True, True))


_buf = torch.zeros(64, dtype=torch.float32)
_buf16 = torch.zeros(64, dtype=torch.bfloat16)
ARGS = [
    _buf, _buf[1:], _buf[2:], _buf[4:], _buf16, _buf16[8:], _buf16[1:], torch.zeros(3, dtype=torch.int64),
    0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -(2 ** 31),
    -(2 ** 31) - 16, 2 ** 63 - 1, 2 ** 63 - 16, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 1,
    0.0, 1.0, 1.5, True, False, None,
]


def test_key_is_at_least_as_fine_as_tritons():
    """Two arguments with one key always have one Triton specialisation (so one compiled kernel)."""
    seen = {}
    for a in ARGS:
        k = L.spec_key((a,))
        t = triton_spec(a)
        assert seen.setdefault(k, t) == t, f"{a!r}: key {k} maps to {seen[k]} and {t}"


@pytest.mark.parametrize("a, b", [
    (_buf, _buf[1:]),            # alignment
    (_buf, _buf16),              # dtype
    (16, 1),                     # the value 1 is compiled in
    (1, 17),
    (16, 17),                    # divisibility by 16
    (16, 2 ** 31 + 16),          # i32 -> i64
    (2 ** 63 - 16, 2 ** 63),     # i64 -> u64
    (0, 0.0),
    (1, True),
    (0, None),
])
def test_key_separates_what_triton_separates(a, b):
    assert triton_spec(a) != triton_spec(b)
    assert L.spec_key((a,)) != L.spec_key((b,))


@pytest.mark.parametrize("v, code", [(1, -1), (0, 1), (16, 1), (-16, 1), (17, 0), (-1, 0), (2 ** 31, 3),
                                     (2 ** 31 + 1, 2), (2 ** 63, 5), (2 ** 63 + 1, 4)])
def test_int_code(v, code):
    assert L.int_code(v) == code


def test_int_beyond_64_bits_is_unsupported():
    with pytest.raises(L.Unsupported):
        L.int_code(2 ** 64)
    with pytest.raises(L.Unsupported):
        L.int_code(-(2 ** 63) - 1)


def test_key_of_constexpr_positions_is_the_value_and_unknown_types_refuse():
    assert L.spec_key((64,), frozenset({0})) != L.spec_key((128,), frozenset({0}))
    assert L.spec_key((64,)) == L.spec_key((128,))
    with pytest.raises(L.Unsupported):
        L.spec_key(("a string",))
    with pytest.raises(L.Unsupported):
        L.spec_key(((1, 2),))


def test_key_of_a_parameter_subclass():
    p = torch.nn.Parameter(torch.zeros(8))
    assert L.spec_key((p,)) == L.spec_key((torch.zeros(8),))


@pytest.mark.parametrize("kw, reason", [
    (dict(kernel_type="JITFunction", triton_version="3.6.0", backend="cuda", env=None), None),
    (dict(kernel_type="JITFunction", triton_version="3.9.0", backend="cuda", env="1"), None),
    (dict(kernel_type="JITFunction", triton_version="3.7.1+git1234", backend="cuda", env=None), None),
    (dict(kernel_type="InterpretedFunction", triton_version="3.9.0", backend="cuda", env=None), "InterpretedFunction"),
    (dict(kernel_type="Autotuner", triton_version="3.9.0", backend="cuda", env=None), "Autotuner"),
    (dict(kernel_type="JITFunction", triton_version="3.5.1", backend="cuda", env=None), "3.5.1"),
    (dict(kernel_type="JITFunction", triton_version="3.10.0", backend="cuda", env=None), "3.10.0"),
    (dict(kernel_type="JITFunction", triton_version="4.0.0", backend="cuda", env=None), "4.0.0"),
    (dict(kernel_type="JITFunction", triton_version="garbage", backend="cuda", env=None), "garbage"),
    (dict(kernel_type="JITFunction", triton_version="3.9.0", backend="hip", env=None), "hip"),
    (dict(kernel_type="JITFunction", triton_version="3.9.0", backend="cuda", env="0"), "PATCHDSL_FAST_LAUNCH"),
    (dict(kernel_type="JITFunction", triton_version="3.9.0", backend="cuda", env="off"), "PATCHDSL_FAST_LAUNCH"),
])
def test_refusals(kw, reason):
    got = L.fast_path_refusal(**kw)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


# ---------------------------------------------------------------------------------- a fake Triton
class _Param:
    def __init__(self, num, constexpr):
        self.num, self.is_constexpr = num, constexpr


class _Chain:  # stands for triton.knobs.HookChain
    def __init__(self):
        self.calls = []


class _Kernel:
    """A 'compiled kernel': its launcher records (kernel, grid, stream, args)."""

    def __init__(self, spec, log):
        self.spec = spec
        self.function = object()
        self.packed_metadata = ("meta", spec)
        self.log = log

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert function is self.function and packed is self.packed_metadata
        self.log.append(("run", self, (g0, g1, g2), stream, args))


class JITFunction:  # the name is what the launcher checks
    """A jit function of ``names`` (upper-case names are constexpr) whose compiler keys kernels
    by Triton's real specialisation of the arguments plus the options."""

    def __init__(self, names, defaults=None):
        self.names = names
        self.defaults = defaults or {}
        self.params = [_Param(i, n.isupper()) for i, n in enumerate(names)]
        self.pre_run_hooks = []
        self.log = []
        self.compiled = {}
        self.device_caches = {0: (self.compiled, {}, None, None, self.bind),
                              1: ({}, {}, None, None, self.bind)}
        self.device = 0

    def bind(self, *args, **kwargs):
        bound = dict(zip(self.names, args))
        opts = {}
        for k, v in kwargs.items():
            (bound if k in self.names else opts)[k] = v
        for n in self.names:
            if n not in bound:
                bound[n] = self.defaults[n]
        bound = {n: bound[n] for n in self.names}
        spec = [("constexpr", v) if n.isupper() else triton_spec(v) for n, v in bound.items()]
        return bound, spec, opts

    def triton_key(self, *args, **kwargs):
        _, spec, opts = self.bind(*args, **kwargs)
        return (self.device, tuple(spec), tuple(sorted(opts.items())))

    intercept = False

    def __getitem__(self, grid):
        if self.intercept:
            return lambda *a, **k: self.log.append(("normal-call",))

        def go(*args, **kwargs):
            bound, _spec, _ = self.bind(*args, **kwargs)
            key = self.triton_key(*args, **kwargs)
            k = self.device_caches[self.device][0].get(key)
            if k is None:
                k = self.device_caches[self.device][0][key] = _Kernel(key, self.log)
                self.log.append(("compile", k))
            self.log.append(("normal", k))
            k.run(*grid, *(1,) * (3 - len(grid)), "stream", k.function, k.packed_metadata, None, None, None,
                  *bound.values())
            return k
        return go


class FakeRuntime:
    version = "3.9.0"

    def __init__(self, fn):
        self.fn = fn
        self.enter, self.exit = _Chain(), _Chain()
        self.stage_hook = None
        self.debug = False
        self.compiled_kernel_type = _Kernel

    def backend(self):
        return "cuda"

    def driver_changed(self):
        return False

    def hooks_idle(self):
        return not self.enter.calls and not self.exit.calls and self.stage_hook is None

    def knob_key(self):
        return (self.debug,)

    def get_current_device(self):
        return self.fn.device

    def get_current_stream(self, dev):
        return f"stream{dev}"

    def binder(self, fn, dev):
        return fn.device_caches[dev][4]

    def kernel_cache(self, fn, dev):
        return fn.device_caches[dev][0]


def _setup(names=("x", "y", "n", "stride", "BLOCK"), defaults=None):
    fn = JITFunction(list(names), defaults)
    rt = FakeRuntime(fn)
    return fn, rt, L.Launcher(fn, runtime=rt)


def _ran(fn, *args, **kwargs):
    """The kernel Triton would pick for these arguments (compiled by now)."""
    return fn.device_caches[fn.device][0][fn.triton_key(*args, **kwargs)]


def test_first_call_launches_normally_then_the_compiled_kernel_directly():
    fn, rt, lau = _setup()
    x, y = torch.zeros(32), torch.zeros(32)
    lau((4,), (x, y, 32, 16), {"BLOCK": 64, "num_warps": 4})
    assert [e[0] for e in fn.log] == ["compile", "normal", "run"]
    fn.log.clear()
    lau((5, 2), (x, y, 48, 32), {"BLOCK": 64, "num_warps": 4})
    assert [e[0] for e in fn.log] == ["run"]  # no normal launch, no compile
    _, k, grid, stream, args = fn.log[0]
    assert k is _ran(fn, x, y, 48, 32, BLOCK=64, num_warps=4)
    assert grid == (5, 2, 1) and stream == "stream0"
    assert args[:4] == (x, y, 48, 32) and args[4] == 64  # every parameter, the constexpr included
    assert lau.fast_calls == 1 and lau.normal_calls == 1


def _random_args(rng):
    base = torch.zeros(64)
    x = rng.choice([base, base[1:], base[4:], base.to(torch.bfloat16), base.to(torch.bfloat16)[1:]])
    n = rng.choice([1, 2, 16, 17, 32, 2 ** 31 + 16])
    stride = rng.choice([1, 16, 48, 3])
    return (x, base[rng.choice([0, 4])], n, stride), {"BLOCK": rng.choice([64, 128]),
                                                     "num_warps": rng.choice([4, 8])}


def test_every_launch_runs_the_kernel_triton_would_pick():
    """Random sequences of alignments, 1s, multiples of 16, dtypes and constexprs: each launch,
    fast or normal, runs exactly the kernel Triton's own specialisation selects."""
    import random

    rng = random.Random(0)
    fn, rt, lau = _setup()
    for _ in range(300):
        args, kwargs = _random_args(rng)
        fn.log.clear()
        lau((1,), args, dict(kwargs))
        runs = [e for e in fn.log if e[0] == "run"]
        assert len(runs) == 1
        assert runs[0][1] is _ran(fn, *args, **kwargs)
        assert all(a is b for a, b in zip(runs[0][4], args))
    assert lau.fast_calls > 100  # the cache was used


def test_alignment_change_relaunches_normally_and_gets_the_other_kernel():
    fn, rt, lau = _setup()
    base = torch.zeros(64)
    lau((1,), (base, base, 32, 16), {"BLOCK": 64})
    lau((1,), (base, base, 32, 16), {"BLOCK": 64})
    fn.log.clear()
    lau((1,), (base[1:], base, 32, 16), {"BLOCK": 64})   # misaligned: another specialisation
    assert [e[0] for e in fn.log] == ["compile", "normal", "run"]
    k_mis = fn.log[-1][1]
    fn.log.clear()
    lau((1,), (base[2:], base, 32, 16), {"BLOCK": 64})   # misaligned again: the same kernel, fast
    assert [e[0] for e in fn.log] == ["run"] and fn.log[0][1] is k_mis
    fn.log.clear()
    lau((1,), (base, base, 1, 16), {"BLOCK": 64})        # n == 1: compiled in, another kernel
    assert fn.log[0][0] == "compile"


def test_device_is_part_of_the_key():
    fn, rt, lau = _setup()
    x = torch.zeros(32)
    lau((1,), (x, x, 32, 16), {"BLOCK": 64})
    fn.device = 1
    fn.log.clear()
    lau((1,), (x, x, 32, 16), {"BLOCK": 64})
    assert [e[0] for e in fn.log] == ["compile", "normal", "run"]
    fn.log.clear()
    lau((1,), (x, x, 32, 16), {"BLOCK": 64})
    assert [e[0] for e in fn.log] == ["run"] and fn.log[0][3] == "stream1"
    assert fn.log[0][1] is fn.device_caches[1][0][fn.triton_key(x, x, 32, 16, BLOCK=64)]


@pytest.mark.parametrize("disturb", ["enter_hook", "exit_hook", "stage_hook", "pre_run_hook", "callable_grid",
                                     "list_grid", "odd_arg", "unhashable_kw"])
def test_normal_launch_whenever_something_is_unexpected(disturb):
    fn, rt, lau = _setup()
    x = torch.zeros(32)
    args, kwargs, grid = [x, x, 32, 16], {"BLOCK": 64}, (1,)
    lau(grid, tuple(args), kwargs)  # cached now
    if disturb == "enter_hook":
        rt.enter.calls.append(print)
    elif disturb == "exit_hook":
        rt.exit.calls.append(print)
    elif disturb == "stage_hook":
        rt.stage_hook = print
    elif disturb == "pre_run_hook":
        fn.pre_run_hooks.append(print)
    elif disturb == "callable_grid":
        grid = lambda meta: (1,)  # noqa: E731
    elif disturb == "list_grid":
        grid = [1]
    elif disturb == "odd_arg":
        args[3] = 16.0 + 0j
    elif disturb == "unhashable_kw":
        kwargs = {"BLOCK": 64, "extra": [1]}

    fn.intercept = True
    fn.log.clear()
    lau(grid, tuple(args), kwargs)
    assert [e[0] for e in fn.log] == ["normal-call"]


def test_debug_knob_is_part_of_the_key():
    fn, rt, lau = _setup()
    x = torch.zeros(32)
    lau((1,), (x, x, 32, 16), {"BLOCK": 64})
    rt.debug = True
    fn.log.clear()
    lau((1,), (x, x, 32, 16), {"BLOCK": 64})
    assert fn.log[0][0] in ("compile", "normal")


def test_defaults_and_keyword_constexprs_are_packed_in_order():
    fn, rt, lau = _setup(("x", "n", "BLOCK", "flag"), defaults={"flag": 7})
    x = torch.zeros(16)
    lau((2,), (x, 5), {"BLOCK": 32})
    lau((2,), (x, 5), {"BLOCK": 32})
    assert fn.log[-1][0] == "run" and fn.log[-1][4] == (x, 5, 32, 7)


def test_cache_is_bounded():
    fn, rt, lau = _setup(("x", "BLOCK"))
    x = torch.zeros(16)
    for b in range(L.MAX_KEYS + 10):
        lau((1,), (x,), {"BLOCK": b})
    assert len(lau.cache) == L.MAX_KEYS


def test_refused_kernels_launch_normally():
    class InterpretedFunction:
        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda *a, **k: self.calls.append((grid, a, k)) or "k"

    f = InterpretedFunction()
    lau = L.Launcher(f)
    assert lau((3,), (1, 2), {"num_warps": 4}) == "k"
    assert lau.refusal and "InterpretedFunction" in lau.refusal
    assert f.calls == [((3,), (1, 2), {"num_warps": 4})]


def test_env_flag_refuses(monkeypatch):
    monkeypatch.setenv(L.ENV_FLAG, "0")
    fn = JITFunction(["x"])
    lau = L.Launcher(fn, runtime=FakeRuntime(fn))
    lau((1,), (torch.zeros(4),), {})
    lau((1,), (torch.zeros(4),), {})
    assert lau.fast_calls == 0 and lau.normal_calls == 2 and "PATCHDSL_FAST_LAUNCH" in lau.refusal


def test_launch_on_this_machine_uses_the_interpreter_path():
    """Without a GPU the kernels are interpreted: ``launch`` must equal ``kernel[grid](...)``."""
    import triton

    from ..kernels.helpers import ON_GPU
    if ON_GPU:
        pytest.skip("CPU check")
    from patchdsl.kernel_support.launch import launch, launcher_of
    from tests.kernels import _launch_kernels as K

    x = torch.arange(10, dtype=torch.float32)
    y = torch.empty_like(x)
    launch(K.add_one, (triton.cdiv(10, 8),), x, y, 10, BLOCK=8)
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)
    assert launcher_of(K.add_one).refusal is not None


# ---------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def _both_ways(fn_call):
    """Outputs of ``fn_call()`` with the fast launch (warm: second call) and with the normal one."""
    import os

    L.reset()
    os.environ.pop(L.ENV_FLAG, None)
    fn_call()
    fast = fn_call()
    os.environ[L.ENV_FLAG] = "0"
    L.reset()
    try:
        normal = fn_call()
    finally:
        os.environ.pop(L.ENV_FLAG, None)
        L.reset()
    return fast, normal


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


GPU_CASES = [
    ("fused_rmsnorm", "RMSNorm", "bf16"),
    ("fused_add_rmsnorm", "RMSNorm", "bf16"),
    ("fused_swiglu", "SwiGLU", "bf16"),
    ("fused_geglu", "GeGLU", "bf16"),
    ("fused_layernorm", "LayerNorm", "bf16"),
    ("fused_qk_norm_rope", "Attention", "bf16"),
    ("fused_rope", "Attention", "bf16"),
    ("fused_cross_entropy", "CausalLM", "bf16"),
    ("fused_linear_cross_entropy", "Linear", "bf16"),
    ("fused_linear_logprobs", "Linear", "bf16"),
]


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op_name, kind, dtype", GPU_CASES)
def test_fast_and_normal_launch_bit_identical(op_name, kind, dtype):
    """Forward and backward of every generated module: the fast launch gives the very bits of the
    normal launch, and it was really taken (the launchers made fast calls)."""
    from tests.launch_cases import case_for

    run = case_for(op_name, kind, dtype)
    fast, normal = _both_ways(run)
    for a, b in itertools.zip_longest(_flat(fast), _flat(normal)):
        assert a is not None and b is not None
        assert torch.equal(a, b), op_name
    run()
    run()
    assert any(lau.fast_calls for lau in L._LAUNCHERS.values()), f"no fast launch happened: {L.refusals()}"


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_alignment_change_takes_the_other_kernel():
    """A misaligned input after aligned ones: the launcher relaunches normally (Triton compiles the
    unaligned specialisation) and the result equals the aligned one's."""
    from tests.launch_cases import rmsnorm_pair

    L.reset()
    f0, n0 = L.counts()
    y_al, y_mis = rmsnorm_pair()
    torch.testing.assert_close(y_al, y_mis, rtol=0, atol=0)
    fast, normal = L.counts()
    assert fast - f0 >= 2 and normal - n0 >= 2   # aligned: first normal, then fast; misaligned: normal again


# ---------------------------------------------------------------------------------- apply_function
class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, flag):
        ctx.k = k
        return x * k if flag else x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None, None


class _WithSetup(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_apply_function_equals_function_apply():
    x = torch.randn(5, requires_grad=True)
    y1 = _Scale.apply(x, 3.0, True)
    y2 = L.apply_function(_Scale, x, 3.0, True)
    assert torch.equal(y1, y2) and type(y1.grad_fn) is type(y2.grad_fn)
    (g1,) = torch.autograd.grad(y1.sum(), x)
    (g2,) = torch.autograd.grad(y2.sum(), x)
    assert torch.equal(g1, g2)
    with torch.no_grad():
        assert L.apply_function(_Scale, x, 2.0, False).grad_fn is None


def test_apply_function_takes_the_python_apply_where_it_must():
    assert L._c_apply_of(_WithSetup) is False           # setup_context: Function.apply binds arguments
    x = torch.randn(3, requires_grad=True)
    assert torch.equal(L.apply_function(_WithSetup, x), x * 2)
    # a functorch transform is active: the same error as Function.apply (no setup_context)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: L.apply_function(_Scale, t, 2.0, True).sum())(torch.randn(3))
    assert torch.equal(torch.func.grad(lambda t: L.apply_function(_WithSetup, t).sum())(torch.randn(3)),
                       torch.full((3,), 2.0))


@pytest.mark.parametrize("a, b", [(0, 4), (1, 4), (4, 4), (5, 4), (1023, 1024), (1025, 1024), (7, 1)])
def test_cdiv(a, b):
    import triton
    assert L.cdiv(a, b) == triton.cdiv(a, b)


# ---------------------------------------------------------------------------------- linear CE host path
@pytest.mark.parametrize("n, reduction, bias", [(40, "mean", False), (16, "none", True), (0, "sum", False)])
def test_linear_ce_chunks_same_under_autocast_and_at_any_row_count(n, reduction, bias):
    """The chunk loop's views and grids (split once, a full chunk's grid reused, the last chunk's
    own) and the autocast switch: results equal with and without an enclosing autocast, for a
    row count that is not a multiple of the chunk, exactly one chunk, and no rows."""
    from tests.kernels.helpers import DEVICE, kernel_for

    facts = {"vocab": 48, "hidden": 16, "bias": bias, "softcap": None, "logits_scaling": None}
    mod = kernel_for("fused_linear_cross_entropy", "CausalLM", facts, "fp32", {"reduction": reduction})
    g = torch.Generator().manual_seed(n)
    h0 = torch.randn(n, 16, generator=g).to(DEVICE)
    w0 = (torch.randn(48, 16, generator=g) * 0.5).to(DEVICE)
    b0 = torch.randn(48, generator=g).to(DEVICE) if bias else None
    y = torch.randint(0, 48, (n,), generator=g).to(DEVICE)

    def run(autocast):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        with torch.autocast(DEVICE.type if hasattr(DEVICE, "type") else str(DEVICE), dtype=torch.bfloat16,
                            enabled=autocast):
            loss = mod.linear_cross_entropy(h, w, b, y)
        loss.sum().backward()
        return [loss.detach(), h.grad, w.grad] + ([b.grad] if bias else [])

    plain, auto = run(False), run(True)
    for a, c in zip(plain, auto):
        assert a is not None and c is not None and torch.equal(a, c)
    if n:
        logits = h0.double() @ w0.double().T + (b0.double() if bias else 0)
        ref = torch.nn.functional.cross_entropy(logits, y, reduction=reduction)
        torch.testing.assert_close(plain[0].double(), ref, rtol=1e-4, atol=1e-5)


def test_counts_and_refusals_report_launches():
    class InterpretedFunction:
        __name__ = "k"

        def __getitem__(self, grid):
            return lambda *a, **k: None

    f = InterpretedFunction()
    f0, n0 = L.counts()
    L.launch(f, (1,), 1)
    L.launch(f, (1,), 2)
    assert L.counts() == (f0, n0 + 2)
    assert "InterpretedFunction" in L.refusals()["k"]


@pytest.mark.parametrize("op_name", ["fused_linear_cross_entropy"])
def test_gpu_case_builder_runs_here(op_name):
    """The GPU tests' case builder (tests/launch_cases.py) on this machine at tiny sizes: two runs
    give the same bits (the interpreter launches normally)."""
    from patchdsl_tools.bench.cases import families
    from tests.launch_cases import BY_OP, case_for

    run = case_for(op_name, dtype="fp32", device="cpu", shape=families()[BY_OP[op_name]].tiny[0])
    a, b = run(), run()
    assert len(a) >= 3 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_triton_runtime_reads_this_tritons_hooks_and_knobs():
    """TritonRuntime against the installed Triton's real knobs (a stub driver stands in for CUDA)."""
    import types

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    stub = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 7,
                                 get_current_target=lambda: GPUTarget("cuda", 90, 32))
    saved = driver._active
    driver._active = stub
    try:
        rt = L.TritonRuntime()
        assert rt.backend() == "cuda" and not rt.driver_changed()
        assert rt.hooks_idle()
        hook = lambda *a: None  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert not rt.hooks_idle()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert rt.hooks_idle()
        k0 = rt.knob_key()
        old = knobs.runtime.debug
        knobs.runtime.debug = not old
        try:
            assert rt.knob_key() != k0
        finally:
            knobs.runtime.debug = old
        driver._active = types.SimpleNamespace(**vars(stub))
        assert rt.driver_changed()
    finally:
        driver._active = saved
