"""Ranks of tests/distributed/test_tensor_parallel.py: ``python -m tests.distributed.tp_worker OUT`` as 4 gloo
processes (RANK, WORLD_SIZE, MASTER_* as torchrun sets them).  One start, many cases:

* TP and TP + sequence parallelism on 2 ranks: the 4 ranks as two pairs (a (2, 2) mesh, its "tp" rows),
  each pair a case of its own at the same time; FSDP2 + TP on the (dp 2, tp 2) mesh; TP over all 4 ranks;
* the vocabulary-parallel loss against a float64 formula (loss and every gradient, 2 and 4 ranks);
* refusals at apply time (a layout an op does not take) and at parallelize_module (the other order).

Rank 0 writes every rank's results as JSON to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import patchdsl  # noqa: F401  (switches the interpreter on without a GPU)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# the MoE families: their shipped specs without the attention rule (the q-k-norm + RoPE and RoPE kernels ran
# under TP above; the interpreter's CPU time goes to the experts, router, norms and loss here)
MOE_SPEC = """
*.input_layernorm, *.post_attention_layernorm, model.norm: RMSNorm -> fused_rmsnorm
*.mlp.experts: Experts -> fused_experts
*.mlp.gate: Router -> fused_router
lm_head: Linear -> fused_linear_cross_entropy(ignore_index=-100, chunk=auto)
"""
SPECS = {"llama": "specs/llama.kpatch", "qwen3": "specs/qwen3.kpatch", "qwen3_moe": MOE_SPEC, "mixtral": MOE_SPEC}
# the MoE tiny configs shrunk further to the dense ones' hidden 64 (their experts dominate the interpreter's time)
SMALL = {"qwen3_moe": (("hidden_size", 64), ("num_attention_heads", 4), ("head_dim", 16), ("moe_intermediate_size", 32)),
         "mixtral": (("hidden_size", 64), ("num_attention_heads", 4), ("head_dim", 16), ("intermediate_size", 64))}
# (pair 0's case, pair 1's case) per round on the two TP pairs
PAIR_ROUNDS = [(("llama", "tp"), ("qwen3", "tp_sp")), (("qwen3", "hf_tp"), ("llama", "tp_sp")),
               (("qwen3_moe", "ep"), ("mixtral", "ep"))]


def transformers_api(layout: str) -> str | None:
    """Why transformers here cannot run ``layout`` (its TP styles and EP dispatch: 5.21 and later), or None."""
    mod = {"hf_tp": "tensor_parallel", "ep": "expert_parallel"}.get(layout)
    if mod is None:
        return None
    try:
        __import__(f"transformers.distributed.{mod}")
    except ImportError as e:
        return f"transformers.distributed.{mod} is not in this transformers ({e})"
    return None


def _run(res, case, mesh):
    from patchdsl.parity.tensor_parallel import run_case

    why = transformers_api(case.layout)
    if why:
        res["skipped"][f"{case.family} {case.layout} x{mesh.size()}"] = why
        return
    res["cases"].append(_safe(run_case, case, mesh))


def _safe(fn, *a):
    import time

    t = time.perf_counter()
    try:
        r = fn(*a)
        if isinstance(r, dict):
            r["seconds"] = round(time.perf_counter() - t, 2)
        return r
    except Exception as e:     # the test shows it; the other ranks must not hang in a collective
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:], "passed": False}


# ------------------------------------------------------------------ the vocabulary-parallel loss
def reference_loss(h, w, b, y, ignore, eps, zl, cap, reduction, num_items):
    """The float64 loss of the whole (unsharded) head: the kernels' reference (tests/kernels/helpers)."""
    from tests.kernels.helpers import ce_reference

    x = h @ w.T
    return ce_reference(x + b if b is not None else x, y, ignore_index=ignore, label_smoothing=eps, softcap=cap,
                        z_loss=zl, reduction=reduction, num_items=num_items)


VOCAB_CASES = [   # (vocab, bias, label_smoothing, z_loss, softcap, reduction, num_items, chunk)
    (37, False, 0.0, 0.0, None, "mean", None, 5),
    (37, True, 0.1, 1e-3, 5.0, "mean", 40.0, 7),
    (40, False, 0.0, 0.0, None, "sum", None, 64),
    (33, True, 0.2, 0.0, 3.0, "mean", None, 8),
]


def vocab_cases(mesh):
    """The vocabulary-parallel loss on ``mesh`` against the float64 formula: loss, grad_hidden, the whole
    grad_weight and grad_bias (gathered), relative errors."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from patchdsl.distributed.vocab import LossSpec, vocab_parallel_linear_cross_entropy

    out = []
    for i, (vocab, bias, eps, zl, cap, red, n_items, chunk) in enumerate(VOCAB_CASES):
        g = torch.Generator().manual_seed(7 + i)
        n, hid = 19, 12
        h = torch.randn(n, hid, generator=g, dtype=torch.float64)
        w = torch.randn(vocab, hid, generator=g, dtype=torch.float64) * 0.5
        b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
        y = torch.randint(0, vocab, (n,), generator=g)
        y[::5] = -100
        hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
        br = b.clone().requires_grad_() if b is not None else None
        ref = reference_loss(hr, wr, br, y, -100, eps, zl, cap, red, n_items)
        ref.backward()
        hp = h.float().requires_grad_()
        wd = distribute_tensor(w.float(), mesh, [Shard(0)]).requires_grad_()
        bd = distribute_tensor(b.float(), mesh, [Shard(0)]).requires_grad_() if b is not None else None
        spec = LossSpec(-100, eps, zl, cap, None, None, red, chunk)
        loss = vocab_parallel_linear_cross_entropy(hp, wd, bd, y, n_items, spec)
        loss.backward()

        def rel(a, r):
            a, r = a.detach().double(), r.detach().double()
            return float((a - r).norm() / r.norm())

        errs = {"loss": rel(loss, ref), "grad_hidden": rel(hp.grad, hr.grad),
                "grad_weight": rel(wd.grad.full_tensor(), wr.grad)}
        if b is not None:
            errs["grad_bias"] = rel(bd.grad.full_tensor(), br.grad)
        out.append({"case": i, "ranks": mesh.size(), "errors": errs})
    return out


# ------------------------------------------------------------------ refusals
def refusals(mesh):
    """Sites whose layout the op does not take, on tiny models parallelised over ``mesh``: apply refuses them
    with the reason (strict=False: the rest patches); and a TP plan after apply is refused at once."""
    from patchdsl.parity.tensor_parallel import parallelise, tiny_config
    from patchdsl.model.tiny import build, quiet
    from patchdsl.runtime.patch import apply

    res = {}
    cfg = tiny_config("qwen3")
    with quiet():
        m = build(cfg)
    parallelise(m, mesh, "tp_sp")
    spec = """
*.input_layernorm, model.norm: RMSNorm -> fused_rmsnorm
model.layers.*: DecoderLayer -> fused_add_rmsnorm
*.mlp: SwiGLU -> fused_swiglu
lm_head: Linear -> fused_linear_logprobs
"""
    from patchdsl.runtime import placements

    before = placements(spec, m)             # what apply will decide, before patching
    h = apply(spec, m)
    res["sp"] = {"patched": sorted(h.patched), "refused": {r.path: r.reason for r in h.refused},
                 "placements": h.placements, "before": before}
    h.undo()
    h = apply('lm_head: Linear -> fused_linear_cross_entropy(reduction="none")', m)
    res["ce_none"] = {r.path: r.reason for r in h.refused}
    h.undo()
    # the other order: patch, then parallelise
    with quiet():
        m = build(cfg)
    h = apply(SPECS["qwen3"], m, strict=True)
    try:
        parallelise(m, mesh, "tp")
        res["after"] = None
    except Exception as e:
        res["after"] = f"{type(e).__name__}: {e}"
    return res


def main(out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from patchdsl.parity.tensor_parallel import Case, run_case  # noqa: F401  (run_case: the must-fail run)

    import time

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "run as 4 processes"
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pair, tp2 = mesh2d.get_coordinate()[0], mesh2d["tp"]
    mesh4 = init_device_mesh("cpu", (4,))
    # expert parallelism: ("ep", "tp") meshes whose "tp" (the ranks sharing one batch) is each rank alone
    ep2 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pair", "ep", "tp"))["ep", "tp"]
    ep4 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("ep", "tp"))
    res: dict = {"cases": [], "vocab": [], "refusals": None, "broken": None, "skipped": {}}
    for rnd in PAIR_ROUNDS:
        fam, layout = rnd[pair]
        _run(res, Case(fam, SPECS[fam], layout, config=SMALL.get(fam, ())), ep2 if layout == "ep" else tp2)
    # over 4 ranks (one expert each) the experts alone: the rest of the spec ran on 2 ranks above (CPU time)
    _run(res, Case("qwen3_moe", "*.mlp.experts: Experts -> fused_experts", "ep", config=SMALL["qwen3_moe"]), ep4)
    for fam in ("llama", "qwen3"):
        _run(res, Case(fam, SPECS[fam], "fsdp_tp"), mesh2d)
    _run(res, Case("llama", SPECS["llama"], "tp"), mesh4)
    res["vocab"] = [_safe(vocab_cases, tp2), _safe(vocab_cases, mesh4)]
    # must fail: the norms' weight gradients under sequence parallelism left as each rank's partial sum
    import patchdsl.distributed.local as local

    keep, local.all_reduce_grad = local.all_reduce_grad, lambda x, group: x
    try:
        res["broken"] = _safe(run_case, Case("llama", SPECS["llama"], "tp_sp"), tp2)
    finally:
        local.all_reduce_grad = keep
    res["refusals"] = _safe(refusals, tp2)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    everything = [None] * world
    dist.all_gather_object(everything, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everything, f, default=repr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
