"""Inputs for the GPU launch tests (tests/kernel_support/test_launch.py): one forward + backward of each
generated module, planned as the bench plans it, on fixed-seed inputs made afresh per call."""

from __future__ import annotations

import torch

# Shapes a little larger than the bench's tiny ones, so that loops and chunks run more than once.
SHAPES = {
    "rmsnorm": {"tokens": 300, "hidden": 1024},
    "add_rmsnorm": {"tokens": 300, "hidden": 1024},
    "layernorm": {"tokens": 300, "hidden": 1000},
    "swiglu": {"tokens": 300, "intermediate": 3072},
    "geglu": {"tokens": 300, "intermediate": 2000},
    "rope": {"batch": 2, "seq": 64, "q_heads": 8, "kv_heads": 2, "head_dim": 128},
    "qk_norm_rope": {"batch": 2, "seq": 64, "q_heads": 8, "kv_heads": 2, "head_dim": 128},
    "cross_entropy": {"tokens": 300, "vocab": 5000},
    "linear_cross_entropy": {"tokens": 3000, "hidden": 256, "vocab": 32000},
    "linear_logprobs": {"tokens": 3000, "hidden": 256, "vocab": 32000},
}
BY_OP = {"fused_" + k: k for k in SHAPES}


def case_for(op_name: str, kind: str = "", dtype: str = "bf16", device: str = "cuda", shape: dict | None = None):
    """``run()`` -> the outputs and the gradients of one forward + backward (fresh inputs each call)."""
    from patchdsl_tools.bench.cases import as_tuple, families

    fam = families()[BY_OP[op_name]]
    shape = shape or SHAPES[fam.name]
    dev = torch.device(device)

    def inputs():
        g = torch.Generator(device=dev).manual_seed(1234)
        params = fam.make_params(shape, dtype, dev, g)
        act = fam.make_act(shape, dtype, dev, g)
        dys = fam.make_dys(shape, dtype, dev, g)
        return params, act, dys

    entry = _entry(fam, shape, dtype)

    def run():
        params, act, dys = inputs()
        outs = as_tuple(entry(fam.patchdsl_values(params, act)))
        outs, _ = fam.fix_outputs(outs, [None if d is None else tuple(d.shape) for d in dys])
        pairs = [(o, d) for o, d in zip(outs, dys) if isinstance(o, torch.Tensor) and o.requires_grad]
        leaves = [act[n] for n in fam.act_grad] + [params[n] for n in fam.param_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves,
                                    [torch.ones_like(o) if d is None else d for o, d in pairs], allow_unused=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return [o.detach().clone() for o in outs if isinstance(o, torch.Tensor)] + \
            [g.clone() for g in grads if g is not None]

    return run


def _entry(fam, shape, dtype):
    """The generated module's entry point, planned as the bench plans it, bound to the family's names."""
    from patchdsl_tools.bench.cases import bind, resolve_entry
    from patchdsl_tools.bench.runner import plan_key
    from patchdsl.codegen import load_kernel, target
    from patchdsl.ops.registry import get_op

    key, _ = plan_key(fam, get_op(fam.op), shape, dtype, target())
    fn, _ = resolve_entry(load_kernel(key), fam.entry_names)
    return bind(fn, fam.synonyms, fam.canon_order)


def rmsnorm_pair():
    """RMSNorm of an aligned input, then of the same values at an address that is not a multiple
    of 16 bytes: (y_aligned, y_misaligned)."""
    from patchdsl_tools.bench.cases import as_tuple, families

    fam = families()["rmsnorm"]
    shape = {"tokens": 64, "hidden": 1024}
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    params = fam.make_params(shape, "bf16", dev, g)
    x = fam.make_act(shape, "bf16", dev, g)["x"].detach()
    entry = _entry(fam, shape, "bf16")

    def call(t):
        return as_tuple(entry(fam.patchdsl_values(params, {"x": t})))[0]
    with torch.no_grad():
        for _ in range(3):
            y_al = call(x)
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=dev)
        xm = buf[1:].view_as(x)
        xm.copy_(x)
        assert xm.data_ptr() % 16 != 0
        y_mis = call(xm)
        y_al2 = call(x)
    assert torch.equal(y_al, y_al2)
    return y_al, y_mis
