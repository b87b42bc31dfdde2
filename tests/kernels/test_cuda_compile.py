"""Every op's cuda-target kernels, forward and backward, compile for sm_90 (CPU only, no GPU).

The Triton interpreter the CPU tests run on accepts code that Triton's GPU compiler rejects, so
here each registered op is installed on a one-layer model of a real family at real widths, the
model runs forward and backward with every kernel launch recorded instead of run, and each
recorded launch is compiled for sm_90 (see tests/kernels/cuda_compile.py).  Nothing here names an
op: a new op is covered as soon as it is registered and some variant below has a module it accepts
(test_every_op_has_a_site says when none does).
"""

import functools

import pytest

from .cuda_compile import (VARIANT_OPS, VARIANTS, _generated_ops, accepted_sites, build_model, compile_variant,
                           flag_homes, flag_variants, resolved_flags)

# Qwen3 in every dtype; the other families (different facts: offset 1 / gelu_tanh / softcap,
# fused gate_up and qkv with partial rotary, LayerNorm with bias) in bf16.  One test per (family,
# dtype), so the pytest-xdist workers share them out and progress shows; each flag variant (another
# compiled-in mode) is compiled once, with the first family that has a site for it (flag_homes), in
# that family's first dtype.
DTYPES = {"qwen3": ["bf16", "fp32", "fp16"], "gemma3": ["bf16"], "phi3": ["bf16"], "stablelm": ["bf16"],
          "qwen3_moe": ["bf16"], "gpt_oss": ["bf16"], "starcoder2": ["bf16"], "glm4": ["bf16"],
          "qwen3_next": ["bf16"], "deepseek_v3": ["bf16"]}
CASES = [(v, dt) for v in VARIANTS for dt in DTYPES[v]]


@pytest.mark.parametrize("variant,dtype", CASES, ids=[f"{v}-{d}" for v, d in CASES])
def test_cuda_kernels_compile_for_sm90(tmp_path, variant, dtype):
    first = dtype == DTYPES[variant][0]
    mine = _homes()[variant] if first else []
    rep = compile_variant(tmp_path, variant, [dtype], flag_variants_too=[[n, fv] for n, fv in mine] or False)
    assert not rep["errors"], "\n\n".join(rep["errors"])[:6000]
    assert rep["modules"], "no generated module was imported"
    if first:
        # an op all of whose flag variants ran here (or that has none): every @triton.jit function of
        # its modules is reached (launched, called from a launched kernel, or its identical source
        # compiled from another mode's module); the default flags alone leave mode-only helpers (e.g.
        # reduction=none's scaling) unreached, so ops whose modes compile with another family are
        # judged there
        complete = {op.name for op in _generated_ops()
                    if all((op.name, fv) in [(n, f) for n, f in mine] for fv in flag_variants(op))}
        names = sorted((op.name for op in _generated_ops()), key=len, reverse=True)

        def op_of(module: str) -> str | None:
            stem = module.rsplit(".", 2)[-2] if module.count(".") >= 1 else module
            return next((n for n in names if stem.startswith(n + "_")), None)
        unreached = [u for u in rep["uncompiled"] if op_of(u) in complete]
        assert not unreached, f"@triton.jit functions never launched nor compiled: {unreached}"
    # every op that had a site launched at least one kernel of its own module (a module that defines
    # Triton kernels: fp8_linear's calls torch._scaled_mm), in every dtype
    compiled_modules = {c["module"] for c in rep["compiled"]}
    assert rep["kernel_modules"], "no generated module with Triton kernels was imported"
    for m in rep["kernel_modules"]:
        assert m in compiled_modules, f"{m} was imported but none of its kernels was launched"
    stems = [m.split(".")[-1] for m in compiled_modules]
    for label, by_dtype in rep["sites"].items():
        for dt, sites in by_dtype.items():
            if sites and " " not in label:     # default flags: every dtype
                assert any(s.startswith(label + "_") and f"_{dt}_" in s for s in stems), (label, dt, sites)


@functools.lru_cache(maxsize=1)
def _homes():
    return flag_homes()


def test_every_flag_variant_has_a_home():
    """Each op's every flag variant is compiled with exactly one family (the first with a site)."""
    homes = _homes()
    placed = [(n, repr(fv)) for v in homes for n, fv in homes[v]]
    assert len(placed) == len(set(placed))
    want = {(op.name, repr(fv)) for op in _generated_ops() for fv in flag_variants(op)}
    assert set(placed) == want, want - set(placed)


def test_every_op_has_a_site():
    """Each registered op accepts a module of some variant, with its default flags and with every
    flag variant the compile test tries (otherwise its kernels would silently go uncompiled)."""
    from patchdsl.model.index import build_index
    from patchdsl.ops.registry import ops

    models = {v: build_model(v, "bf16", meta=True) for v in VARIANTS}
    indexes = {v: build_index(m) for v, m in models.items()}
    for op in ops().values():
        if op.external or not op.triton_kernels:    # third-party kernels, or torch's: nothing to compile
            continue
        for overrides in [{}] + flag_variants(op):
            flags = resolved_flags(op, overrides)
            where = [v for v in VARIANTS if op.name in VARIANT_OPS.get(v, (op.name,))
                     and accepted_sites(op, models[v], indexes[v], flags)]
            assert where, f"{op.name} {overrides}: no variant of tests/kernels/cuda_compile.py has a site for it"
