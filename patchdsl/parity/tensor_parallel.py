"""verify under tensor parallelism: a tiny model of a family, parallelised (TP, TP + sequence parallelism,
FSDP2 + TP on a 2-D mesh) and patched, trained a few steps beside the single-process unpatched model in
float32 and in float64, every step's loss and every final parameter judged with verify's rule
(:mod:`patchdsl.parity.compare`: the patched error against float64 within 4x the unpatched error plus
the dtype's floor).

Run in every rank of an initialised process group (gloo on the CPU, NCCL on GPUs):
:func:`run_case` takes the mesh; :func:`main` is the torchrun entry
(``torchrun --nproc-per-node 2 -m patchdsl.parity.tensor_parallel --family llama --spec specs/llama.kpatch``).
The plans are transformers' ``base_model_tp_plan`` layouts written with ``parallelize_module``:
q/k/v and gate/up colwise, o/down rowwise, the LM head colwise; with ``sequence=True`` the residual
stream between the layers is sharded over the sequence (norms under ``SequenceParallel``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from .compare import errors, judge, tolerance_for

LAYOUTS = ("tp", "hf_tp", "tp_sp", "fsdp_tp", "ep")


@dataclass(frozen=True)
class Case:
    family: str                  # a model type with a shipped tiny config (llama, qwen3, ...)
    spec: str                    # spec text or path
    layout: str = "tp"           # one of LAYOUTS
    steps: int = 3
    batch: int = 1
    seq: int = 16
    lr: float = 1e-3
    seed: int = 0
    config: tuple[tuple[str, Any], ...] = ()     # config fields set on the tiny config (smaller still)


def tiny_config(family: str, config: tuple[tuple[str, Any], ...] = ()):
    from ..model.tiny import tiny_family_config

    cfg = tiny_family_config(family)
    for k, v in config:
        setattr(cfg, k, v)
    cfg.tie_word_embeddings = False      # a colwise LM head cannot share the (replicated) embedding's weight
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def tp_plan(model: Any, sequence: bool = False) -> dict[str, Any]:
    """``parallelize_module``'s plan for ``model``: its config's ``base_model_tp_plan`` colwise / rowwise
    entries (other styles - packed, experts, replicated norms - left out), the LM head colwise; with
    ``sequence`` the norms under SequenceParallel and the activations between them sharded over the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    out_layout = Shard(1) if sequence else Replicate()
    plan: dict[str, Any] = {}
    names = dict(model.named_modules())
    n_layers = model.config.num_hidden_layers
    for i in range(n_layers):
        for key, style in base.items():
            if not key.startswith("layers.*."):
                continue
            path = f"model.layers.{i}.{key[len('layers.*.'):]}"
            if path not in names:
                continue
            if style == "colwise":
                plan[path] = ColwiseParallel()
            elif style == "rowwise":
                plan[path] = RowwiseParallel(output_layouts=out_layout)
        if sequence:
            p = f"model.layers.{i}."
            plan[p + "input_layernorm"] = SequenceParallel()
            plan[p + "post_attention_layernorm"] = SequenceParallel()
            plan[p + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()})
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if sequence:
        # the embeddings' output (whole: the rotary embedding and the mask want every position) split
        # over the sequence as the first layer's input; the final norm gives it back Shard(1)
        plan["model.layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                    use_local_output=True)
        plan["model.norm"] = SequenceParallel()
    plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sequence else Replicate(), output_layouts=Replicate())
    return plan


def _expand(model: Any, base: dict[str, str], prefix: str = "model.") -> dict[str, str]:
    """A transformers plan's ``layers.*.`` keys as the model's own module / parameter names."""
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    plan = {}
    for key, style in base.items():
        for i in range(model.config.num_hidden_layers) if "*" in key else (None,):
            path = prefix + (key.replace("*", str(i)) if i is not None else key)
            if path in names:
                plan[path] = style
    return plan


def transformers_tp(model: Any, mesh: Any) -> Any:
    """transformers' own tensor parallelism (what ``from_pretrained(..., tp_plan="auto")`` applies): the
    config's ``base_model_tp_plan`` and the causal LM's ``_tp_plan`` through its ``apply_tensor_parallelism``
    (its styles: colwise / rowwise, q_norm / k_norm replicated_with_grad_allreduce, the LM head
    colwise_gather_output)."""
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism
    except ImportError as e:
        raise RuntimeError(f"transformers' tensor-parallel API (transformers.distributed.tensor_parallel, 5.21 "
                           f"and later) is not here: {e}") from None
    plan = _expand(model, dict(getattr(model.config, "base_model_tp_plan", None) or {}))
    plan.update(_expand(model, dict(getattr(type(model), "_tp_plan", None) or {}), prefix=""))
    # from_pretrained shards each weight as it loads it, by its module's style; here the weights exist
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if name in modules:
            for pname in list(modules[name]._parameters):
                ALL_PARALLEL_STYLES[style].shard_param(modules[name], pname, mesh)
    return apply_tensor_parallelism(model, mesh, plan)


def expert_parallel(model: Any, mesh: Any) -> Any:
    """transformers' expert parallelism (its ``base_model_ep_plan``: the experts' weights Shard(0) over
    ``mesh["ep"]``, the experts reached through its all-to-all dispatch), with ``mesh["tp"]`` the ranks holding
    one batch (size 1 here: every EP rank holds a batch of its own)."""
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError as e:
        raise RuntimeError(f"expert parallelism needs transformers' expert-parallel API "
                           f"(transformers.distributed.expert_parallel, 5.21 and later): {e}") from None
    base = dict(getattr(model.config, "base_model_ep_plan", None) or {})
    if not base:
        raise ValueError(f"{type(model).__name__} has no base_model_ep_plan")
    return apply_expert_parallelism(model, mesh["ep"], mesh["tp"], _expand(model, base))


def parallelise(model: Any, mesh: Any, layout: str) -> Any:
    """``model`` under ``layout``: "tp" / "tp_sp" on a 1-D mesh; "fsdp_tp" on a 2-D ("dp", "tp") mesh (TP
    first, then fully_shard per decoder layer and at the root over "dp", torchtitan's order); "ep" on an
    ("ep", "tp") mesh, transformers' expert parallelism (:func:`expert_parallel`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "ep":
        return expert_parallel(model, mesh)
    if layout == "hf_tp":
        return transformers_tp(model, mesh)
    tp = mesh["tp"] if layout == "fsdp_tp" else mesh
    parallelize_module(model, tp, tp_plan(model, sequence=layout == "tp_sp"))
    if layout == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _batches(case: Case, vocab: int, n: int):
    import torch

    g = torch.Generator().manual_seed(1000 + case.seed)
    return [torch.randint(0, vocab, (case.batch * n, case.seq), generator=g) for _ in range(case.steps)]


def _average_grads(model: Any, group_mesh: Any) -> None:
    """What data parallelism over the EP ranks does (each holds a batch of its own): the replicated
    parameters' gradients averaged; an expert's (held by one rank, reached by every rank's tokens) divided."""
    import torch.distributed as dist

    n = group_mesh.size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if not any(c.__name__ == "DTensor" for c in type(p).__mro__):
            dist.all_reduce(p.grad, group=group_mesh.get_group())
        p.grad.div_(n)


def _full(p: Any) -> Any:
    return p.full_tensor() if any(c.__name__ == "DTensor" for c in type(p).__mro__) else p


def run_case(case: Case, mesh: Any, spec_dir: str | None = None) -> dict[str, Any]:
    """Train the case's model parallelised and patched on ``mesh`` and, on every rank, the single-process
    unpatched model in float32 and float64 on the same (global) batches; return the judged rows."""
    import torch
    import torch.distributed as dist

    from ..model.tiny import build, quiet
    from ..runtime.patch import apply

    cfg = tiny_config(case.family, case.config)
    with quiet():
        ref = build(cfg, case.seed).double()
        hf = build(cfg, case.seed)
        par = build(cfg, case.seed)
    for m in (ref, hf, par):
        m.config.use_cache = False
        m.train()
    dp = mesh["dp"] if case.layout == "fsdp_tp" else mesh["ep"] if case.layout == "ep" else None
    n_dp, dp_rank = (dp.size(), dp.get_local_rank()) if dp is not None else (1, 0)
    parallelise(par, mesh, case.layout)
    spec = case.spec
    if spec_dir and not os.path.isabs(spec) and spec.endswith(".kpatch"):
        spec = os.path.join(spec_dir, spec)
    handle = apply(spec, par, strict=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=case.lr, foreach=False) for m in (ref, hf, par)]
    tol = tolerance_for("fp32")
    rows = []
    for step, ids in enumerate(_batches(case, cfg.vocab_size, n_dp)):
        mine = ids.chunk(n_dp)[dp_rank]
        losses = []
        for m, opt, x in ((ref, opts[0], ids), (hf, opts[1], ids), (par, opts[2], mine)):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            if m is par and case.layout == "ep":
                _average_grads(par, dp)
            opt.step()
            losses.append(loss.detach())
        lp = losses[2].clone()
        if dp is not None:
            dist.all_reduce(lp, group=dp.get_group())
            lp /= n_dp
        ok, e_hf, bound = judge(errors(lp, losses[0]), errors(losses[1].float(), losses[0]), tol)
        rows.append({"name": f"loss step {step + 1}", "ok": ok, "err": errors(lp, losses[0]).rel_fro,
                     "err_unpatched": e_hf, "bound": bound, "value": float(lp)})
    want = dict(ref.named_parameters())
    plain = dict(hf.named_parameters())
    for name, p in par.named_parameters():
        full = _full(p.detach())
        r = want[name]
        ep, eh = errors(full, r), errors(plain[name].detach(), r)
        ok, e_hf, bound = judge(ep, eh, tol)
        rows.append({"name": name, "ok": ok, "err": ep.rel_fro, "err_unpatched": e_hf, "bound": bound})
    return {"case": f"{case.family} {case.layout} x{mesh.size()}", "patched": len(handle.patched),
            "dispatch": _dispatch(par, handle),
            "placements": dict(handle.placements), "rows": rows,
            "passed": all(r["ok"] for r in rows)}


def _dispatch(model: Any, handle: Any) -> dict[str, list[str]]:
    """For each site under expert parallelism: what transformers' dispatch calls (the patched forward's name)."""
    from ..distributed.local import ep_implementations

    mods = dict(model.named_modules())
    out = {}
    for path, where in handle.placements.items():
        if where.startswith("experts"):
            impls, _ = ep_implementations(mods[path])
            out[path] = [f"{i.experts_forward.__func__.__module__}.{i.experts_forward.__func__.__qualname__}"
                         for i in impls]
    return out


def report_lines(result: dict[str, Any]) -> list[str]:
    """What people read: one line per loss step, the parameter rows folded to the worst one, the verdict."""
    rows = result["rows"]
    losses = [r for r in rows if r["name"].startswith("loss step")]
    params = [r for r in rows if not r["name"].startswith("loss step")]
    out = [f"{result['case']}: {result['patched']} site(s) patched"]
    out += [f"  {site}: {where}" for site, where in sorted(result["placements"].items())]
    for r in losses:
        out.append(f"  {r['name']}: {r['value']:.6f}  err {r['err']:.2e} <= {r['bound']:.2e}  "
                   f"{'ok' if r['ok'] else 'FAIL'}")
    bad = [r for r in params if not r["ok"]]
    worst = max(params, key=lambda r: r["err"] / r["bound"] if r["bound"] else 0.0)
    out.append(f"  {len(params)} final parameters, worst {worst['name']}: err {worst['err']:.2e} <= "
               f"{worst['bound']:.2e}" + ("" if not bad else f"; FAIL: {', '.join(r['name'] for r in bad[:6])}"))
    out.append(f"  {'PASS' if result['passed'] else 'FAIL'}")
    return out


def spawn(case: Case, nproc: int, timeout: float = 1800) -> dict[str, Any]:
    """Run ``case`` as ``nproc`` gloo processes on this machine (the environment torchrun sets, a free port
    on the loopback) and return rank 0's result; RuntimeError with every rank's output tail when one fails."""
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    loopback = next((n for _, n in socket.if_nameindex() if n in ("lo", "lo0")), None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, "-m", "patchdsl.parity.tensor_parallel", "--family", case.family, "--spec", case.spec,
                "--layout", case.layout, "--steps", str(case.steps), "--json", out]
        procs = []
        for r in range(nproc):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
            if loopback:
                env["GLOO_SOCKET_IFNAME"] = loopback
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate()[0] + f"\n[killed after {timeout:.0f} s]")
        if not os.path.isfile(out) or any(p.returncode not in (0, 1) for p in procs):
            tails = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{o[-3000:]}"
                               for r, (p, o) in enumerate(zip(procs, outs)))
            raise RuntimeError(f"the {nproc} processes of {case.family} {case.layout} failed:\n{tails}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: ``torchrun --nproc-per-node N -m patchdsl.parity.tensor_parallel --family F --spec S
    [--layout tp|tp_sp|fsdp_tp]``: gloo processes on the CPU (the tiny model, fp32).  Exit 0 when every row passes."""
    import argparse

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ap = argparse.ArgumentParser(prog="python -m patchdsl.parity.tensor_parallel")
    ap.add_argument("--family", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--layout", choices=LAYOUTS, default="tp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args(argv)
    if a.json_out:          # before any process group: a FIFO, a device or a folder is refused now (exit 2)
        from ..util import files

        try:
            files.check_writable(a.json_out, what="--json")
        except files.FileWriteError as e:
            print(e, file=sys.stderr)
            return 2
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dev = "cpu"
    if a.layout == "fsdp_tp":
        if world % 2:
            raise SystemExit("fsdp_tp needs an even number of processes (a (world/2, 2) mesh)")
        mesh = init_device_mesh(dev, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh(dev, (world,))
    res = run_case(Case(a.family, a.spec, a.layout, steps=a.steps), mesh)
    if dist.get_rank() == 0:
        print("\n".join(report_lines(res)), flush=True)
        if a.json_out:
            from ..util import files

            files.write_text(a.json_out, json.dumps(res, indent=1), what="--json")
    dist.destroy_process_group()
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
