"""FSDP2 training of a patched model vs the unpatched one, one process per device (torchrun).

Run by ``bench/fsdp2_two_gpu.py`` (two H200s, NCCL) and by the CPU tests (gloo, tiny model).
Every variant builds the same model from the same seed, optionally patches it with the spec
(patch first), wraps it with ``fully_shard`` per decoder layer and then at the root (tied
embeddings stay one parameter of the root's group), optionally ``torch.compile``s it, and trains
``steps`` AdamW steps on the same per-rank batches.  Variants:

* ``ref64``            the unpatched model in float64: the reference the verify rule needs
* ``unpatched``        the unpatched model in the run dtype
* ``patched``          patched with the spec
* ``patched+compile``  patched, then sharded, then ``torch.compile(model, backend=...)``
* ``unpatched+compile``
* ``shard-then-patch`` the other order: ``fully_shard`` first, then plan and apply on the sharded model

In bf16 the parameters stay fp32 (sharded, AdamW's state fp32) and FSDP2 gathers them in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), the usual FSDP2 recipe.

Per step, the loss averaged over ranks is judged as ``patchdsl verify`` does: against ``ref64``,
the patched error must be within ``FACTOR * unpatched error + FLOOR[dtype]``.  Rank 0 prints the
losses side by side, tokens/s and peak memory per rank, and writes JSON to ``--out``.

``--record-head`` (tests) records the shape of the lm_head weight the fused linear cross entropy
receives at call time, to show FSDP2 gathered it (a shard would have ``vocab / world`` rows).

Environment (torchrun sets it): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = ("ref64", "unpatched", "patched", "patched+compile", "unpatched+compile", "shard-then-patch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="hub id / config (shipped configs work offline)")
    p.add_argument("--spec", default="qwen3", help="spec path or shipped spec name")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture (CPU smoke runs)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="ref64,unpatched,patched,patched+compile",
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; aot_eager on the CPU)")
    p.add_argument("--attn", default="sdpa", help="attn_implementation")
    p.add_argument("--head-unit", action="store_true",
                   help="also fully_shard lm_head as its own unit (unties the embeddings first: a tied weight "
                        "cannot live in two units); the fused loss then runs inside lm_head's call")
    p.add_argument("--ref-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="gradient checkpointing for the float64 reference (default: on with CUDA)")
    p.add_argument("--record-head", action="store_true",
                   help="record the lm_head weight shape the fused loss receives (tests)")
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    a = p.parse_args(argv)
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    return a


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[fsdp2] {msg}", file=sys.stderr, flush=True)


def _init(device: str):
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world != 1:
            raise SystemExit("MASTER_PORT is not set: launch with torchrun (or set RANK/WORLD_SIZE/MASTER_*)")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    kw: dict[str, Any] = {}
    if backend == "nccl":
        kw["device_id"] = dev
    dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    return rank, world, dev


def _build(a, dtype):
    from patchdsl.model import load_model

    import torch

    # built in fp32 and converted, so that the float64 reference starts from the same weights
    lm = load_model(a.model, dtype=torch.float32, device="cpu", weights=False, attn_implementation=a.attn,
                    tiny=a.tiny, seed=a.seed, log=None)
    model = lm.model.to(dtype)
    model.config.use_cache = False
    return model


def decoder_layers(model) -> list:
    """The decoder layers (the blocks FSDP2 wraps one by one): the ModuleList of the DecoderLayer kind."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers to shard")
    return list(layers)


def untie(model) -> None:
    """Give lm_head its own copy of the embedding matrix (same values) and say so in the config."""
    import torch

    if model.lm_head.weight is model.get_input_embeddings().weight:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def shard(model, dtype_name: str, head_unit: bool = False):
    """fully_shard per decoder layer (and lm_head alone if asked), then the root; bf16 keeps fp32
    sharded params and gathers them in bf16 (mixed precision)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if dtype_name == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    if head_unit:
        fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)
    return model


class HeadRecorder:
    """Wraps the generated linear-cross-entropy entry point to record the weight shape it receives."""

    def __init__(self):
        self.shapes: list[list[int]] = []
        self._undo: list = []

    def install(self) -> None:
        for name, mod in list(sys.modules.items()):
            if name.startswith("patchdsl_kernels.") and hasattr(mod, "linear_cross_entropy"):
                fn = mod.linear_cross_entropy

                def wrapped(h, w, *rest, _fn=fn, **kw):
                    self.shapes.append(list(w.shape))
                    return _fn(h, w, *rest, **kw)

                self._undo.append((mod, fn))
                mod.linear_cross_entropy = wrapped

    def remove(self) -> None:
        for mod, fn in self._undo:
            mod.linear_cross_entropy = fn
        self._undo.clear()


def run_variant(a, variant: str, rank: int, world: int, dev) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import patchdsl

    run_dtype = "fp64" if variant == "ref64" else a.dtype
    param_dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.float32}[run_dtype]
    rec: dict[str, Any] = {"variant": variant, "dtype": run_dtype}
    model = _build(a, param_dtype)
    if a.head_unit:
        untie(model)
    if variant == "ref64" and a.ref_checkpointing:
        # float64 activations of a real-size batch would not fit; recomputation does not change values
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        rec["gradient_checkpointing"] = True
    recorder = None
    handle = None

    def patch():
        nonlocal recorder, handle
        plan = patchdsl.plan(a.spec, model, dtypes=(a.dtype,))
        handle = patchdsl.apply(plan, model)
        rec["patched_sites"] = len(handle.patched)
        rec["refused"] = [str(r) for r in handle.refused]
        if a.record_head and "compile" not in variant:
            recorder = HeadRecorder()
            recorder.install()

    model.to(dev)                                     # before planning: the plan checks that the kernels' target
    if variant.startswith("patched"):                 # is where the parameters are (the H200 refused every site
        patch()                                       # planned on the CPU copy); patch first, then shard
    shard(model, run_dtype, a.head_unit)
    if variant == "shard-then-patch":
        patch()
    model.train()
    if variant.endswith("+compile"):
        backend = a.compile_backend or ("inductor" if dev.type == "cuda" else "aot_eager")
        rec["compile_backend"] = backend
        model = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    vocab = (model._orig_mod if hasattr(model, "_orig_mod") else model).config.vocab_size
    g = torch.Generator().manual_seed(a.seed * 1000 + rank + 1)
    losses, times = [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for step in range(a.steps):
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().to(torch.float64)
        dist.all_reduce(loss)                         # also the step's synchronisation point
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
        losses.append(float(loss) / world)
        _say(rank, f"{variant:18s} step {step + 1:3d}/{a.steps}  loss {losses[-1]:.6f}  {times[-1] * 1e3:8.1f} ms")
    if recorder is not None:
        recorder.remove()
        rec["head_weight_shapes"] = recorder.shapes
    timed = times[2:] if len(times) > 4 else times[1:] or times
    tokens = a.batch * a.seq * world
    rec["losses"] = losses
    rec["step_ms"] = [t * 1e3 for t in times]
    rec["tokens_per_s"] = tokens * len(timed) / sum(timed) if sum(timed) > 0 else None
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, peak)
    rec["peak_gib_per_rank"] = peaks
    if handle is not None and not variant.endswith("+compile"):
        # undo on the sharded model (after the measurements): every patched forward goes, and the
        # FSDP2 model still runs a training step
        handle.undo()
        rec["undo_leaves_patched_forwards"] = sum("forward" in m.__dict__ for m in model.modules())
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.zero_grad(set_to_none=True)
        rec["loss_after_undo_finite"] = bool(torch.isfinite(out.loss.detach()).item())
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def judge(results: dict[str, dict], dtype: str) -> list[dict[str, Any]]:
    """Per step, for each patched variant: |p - ref64| <= FACTOR * |unpatched - ref64| + FLOOR * |ref64| (verify's rule)."""
    from patchdsl.parity import FACTOR, FLOORS

    ref, base = results.get("ref64"), results.get("unpatched")
    rows = []
    for name, r in results.items():
        if name in ("ref64", "unpatched", "unpatched+compile"):
            continue
        for i, p in enumerate(r["losses"]):
            row: dict[str, Any] = {"variant": name, "step": i + 1, "loss": p}
            if ref is not None and base is not None:
                r64, h = ref["losses"][i], base["losses"][i]
                ep, eh = abs(p - r64) / abs(r64), abs(h - r64) / abs(r64)
                bound = FACTOR * eh + FLOORS[dtype]
                row.update({"err": ep, "unpatched_err": eh, "bound": bound, "ok": math.isfinite(p) and ep <= bound})
            elif base is not None:
                h = base["losses"][i]
                ep = abs(p - h) / abs(h)
                bound = FLOORS[dtype]
                row.update({"err_vs_unpatched": ep, "bound": bound, "ok": math.isfinite(p) and ep <= bound})
            rows.append(row)
    return rows


def table(results: dict[str, dict]) -> str:
    names = list(results)
    steps = max(len(r["losses"]) for r in results.values())
    w = max(12, *(len(n) for n in names))
    lines = ["step " + "".join(f"{n:>{w + 2}s}" for n in names)]
    for i in range(steps):
        lines.append(f"{i + 1:4d} " + "".join(f"{results[n]['losses'][i]:>{w + 2}.6f}" for n in names))
    tps = ["-" if results[n]["tokens_per_s"] is None else f"{results[n]['tokens_per_s']:.0f}" for n in names]
    lines.append("tok/s" + "".join(f"{t:>{w + 2}s}" for t in tps))
    for n in names:
        pk = results[n]["peak_gib_per_rank"]
        if any(p is not None for p in pk):
            lines.append(f"peak GiB per rank, {n}: " + ", ".join(f"{p:.2f}" for p in pk))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.out:
        from patchdsl.util import files

        try:        # before the ranks start: a FIFO, a device, a folder or an unwritable file is refused now
            if files.exists(a.out) or os.path.islink(a.out):
                files.check_writable(a.out, what="--out")
        except files.FileWriteError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and a.dtype == "bf16" and a.tiny:
        pass   # allowed, but slow on the interpreter
    if a.ref_checkpointing is None:
        a.ref_checkpointing = device == "cuda"
    rank, world, dev = _init(device)
    import torch.distributed as dist

    try:
        results: dict[str, dict] = {}
        for v in a.variants.split(","):
            _say(rank, f"variant {v} on {world} rank(s), {dev.type}")
            try:
                results[v] = run_variant(a, v, rank, world, dev)
            except Exception as e:
                if not v.endswith("+compile"):
                    raise
                import traceback

                results[v] = {"variant": v, "error": f"{type(e).__name__}: {e}",
                              "traceback": traceback.format_exc(limit=20)}
                _say(rank, f"{v} failed: {type(e).__name__}: {str(e)[:400]}")
            dist.barrier()
        ok = {k: r for k, r in results.items() if "losses" in r}
        rows = judge(ok, a.dtype)
        passed = all(r.get("ok", True) for r in rows)
        if rank == 0:
            print(table(ok))
            for r in rows:
                if not r.get("ok", True):
                    print(f"MISMATCH {r}")
            print("losses agree within verify tolerances" if passed else "LOSSES DISAGREE")
            if a.out:
                doc = {"args": vars(a), "world_size": world, "device": dev.type,
                       "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                       "versions": {"torch": torch.__version__, "triton": _ver("triton"),
                                    "transformers": _ver("transformers")},
                       "variants": results, "judged": rows, "passed": passed}
                from patchdsl.util import files

                files.write_text(a.out, json.dumps(doc, indent=1), what="--out", parents=True)
        return 0 if passed else 1
    finally:
        dist.destroy_process_group()


def _ver(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
