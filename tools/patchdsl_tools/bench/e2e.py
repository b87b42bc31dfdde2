"""End-to-end training throughput of a causal LM (random weights), bf16, fused AdamW, sdpa attention.

Variants (``--variants``), each on a fresh model instance with the same initial weights and the
same batches:

* ``hf``: the model as transformers builds it;
* ``compile``: ``torch.compile(model)`` of the unpatched model;
* ``liger``: ``liger_kernel.transformers.apply_liger_kernel_to_<model_type>(model=...)``;
* ``patchdsl``: ``patchdsl.apply(plan, model)`` with the spec (rules whose op is not in the
  registry yet are dropped and listed in the result);
* ``patchdsl+compile``: ``patchdsl.compile_model`` of the patched model (``torch.compile`` of the whole
  model with transformers' mask decisions as in eager: no materialised causal mask);
* ``patchdsl+regional``: ``patchdsl.compile_layers`` (each decoder layer compiled, torchtitan's
  regional compile; mask, embedding, final norm and loss head eager);
* ``patchdsl+plain_compile``: plain ``torch.compile(model)`` of the patched model (what a user gets
  without patchdsl's helpers: transformers builds a full mask under Dynamo);
* ``patchdsl+graphs``: the patched model's whole step (forward, backward, AdamW with
  ``capturable=True``) captured once as a CUDA graph by ``patchdsl.graph_step`` and replayed for
  every batch (CUDA only).  Its capture (warm-up + capture, the model state restored) is
  ``capture_s``, outside the timed steps and the warm-up steps; its peak memory is measured after
  the capture and adds the graph's private pool (``pool_free_bytes``: the activations, which the
  allocator counts as free between replays); ``capture_peak_bytes`` is the peak while capturing,
  which holds a copy of the weights and optimizer state.

``--spec`` may be given several times: the two patchdsl variants then give one row per spec
(``patchdsl:qwen3``, ``patchdsl:qwen3_addnorm``), so spec variants compare in one run.  Without
``--spec`` the shipped spec of the model's family is used.  A spec is a path, a shipped name
(``specs/<name>.kpatch``) or a benchmark variant (``bench/specs/<name>.kpatch`` of a checkout).
``--batch 1,4`` gives a row per batch size.

Every row runs in its own process (``python -m patchdsl_tools.bench.e2e --worker``) unless
``isolate=False``: one variant's allocator state, compiled graphs or rebinding of transformers'
names (Liger) cannot affect another, and a crash (a CUDA error, a segfault, a hang past its
time limit) becomes an error row instead of ending the run.  Initial weights agree across
processes because each builds the model from the same seed on the same device (the first loss of
every variant shows it); batches come from a seeded CPU generator.

Per row: tokens/s over the measured steps (synchronised wall clock), step time, peak memory
(``torch.cuda.max_memory_allocated``: weights, gradients, optimizer state and activations), the
loss of every step (warm-up included), the wall time of the warm-up steps (compilation shows
there) and, on CUDA, the host's share of one step: ``host_issue_ms`` is the CPU time to issue a
whole training step after a synchronisation (no sync inside), ``gpu_step_ms`` the GPU time of that
step by CUDA events; ``host_issue_ms`` close to ``step_ms`` means the CPU bounds the step.  When a
batch does not fit, the row retries in a fresh process with half the micro-batch and gradient
accumulation (``oom_retry``), and says so.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from patchdsl.util import files
from patchdsl.util.vocab import torch_dtype
from . import timing

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, hidden_act="silu",
                 attention_bias=False, use_cache=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)

VARIANTS = ("hf", "compile", "liger", "patchdsl", "patchdsl+compile", "patchdsl+regional", "patchdsl+plain_compile",
            "patchdsl+graphs")
PATCHED = ("patchdsl", "patchdsl+compile", "patchdsl+regional", "patchdsl+plain_compile", "patchdsl+graphs")
COMPILED = ("compile", "patchdsl+compile", "patchdsl+regional", "patchdsl+plain_compile")
GRAPHED = ("patchdsl+graphs",)
UNPATCHED = ("hf", "compile")          # the loss reference, in this order of preference
KIND = "patchdsl-bench-e2e"


@dataclass
class E2EOptions:
    device: str = "cuda"
    model: str = "Qwen/Qwen3-0.6B"
    spec: str | None = None             # one spec (kept for callers of the single-spec API)
    specs: tuple[str, ...] = ()         # several specs: a patchdsl row per spec
    dtype: str = "bf16"
    batch: int = 16
    batches: tuple[int, ...] = ()       # several batch sizes: a row per batch size
    seq: int = 2048
    micro_batch: int | None = None
    steps: int = 5
    warmup: int = 2
    lr: float = 1e-4
    seed: int = 0
    variants: tuple[str, ...] = ("hf", "patchdsl", "liger")
    tiny: bool = False
    attn: str = "sdpa"
    budget_s: float = 1e9               # hard: rows not started by then are skipped, a running one is stopped
    variant_timeout_s: float = 1e9      # per process
    oom_retry: bool = True
    isolate: bool = True                # a fresh process per row
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    compile_warmup: int | None = None   # warm-up steps of the compiled rows (default: warmup)
    json_path: str | None = None
    quiet: bool = False

    def spec_list(self) -> tuple[str, ...]:
        return tuple(self.specs) or ((self.spec,) if self.spec else (default_spec(self.model),))

    def batch_list(self) -> tuple[int, ...]:
        return tuple(self.batches) or (self.batch,)


@dataclass(frozen=True)
class Row:
    """One measured configuration: a variant, its spec (patched variants only), a batch size."""
    name: str
    variant: str
    spec: str | None = None            # resolved path
    spec_label: str | None = None
    batch: int = 16


def _log(o: E2EOptions, t0: float, msg: str) -> None:
    if not o.quiet:
        print(f"[e2e {time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- specs and rows
def _model_type(model: str) -> str | None:
    """The model_type of a Hub id with a shipped config, or of a local config.json / model folder; no torch."""
    p = Path(model).expanduser()
    cands = [p / "config.json", p] if p.exists() else []
    try:
        from patchdsl.model.loading import shipped_config_path

        sp = shipped_config_path(model)
        if sp is not None:
            cands.append(sp)
    except Exception:
        pass
    for c in cands:
        try:
            if c.is_file():
                return json.loads(c.read_text()).get("model_type")
        except (OSError, ValueError):
            continue
    return None


def default_spec(model: str) -> str:
    """The shipped spec of ``model``'s family (``specs/<family>.kpatch``), by its model_type."""
    from patchdsl.util.resources import specs_dir

    mt = _model_type(model)
    if mt:
        for name in (mt, mt.removesuffix("_text"), mt.split("_")[0]):
            if (specs_dir() / f"{name}.kpatch").is_file():
                return name
    shipped = sorted(p.stem for p in specs_dir().glob("*.kpatch"))
    raise ValueError(f"no shipped spec for model {model!r} (model_type {mt!r}); pass --spec "
                     f"(shipped: {', '.join(shipped)})")


def bench_specs_dir() -> Path:
    """``bench/specs/`` of the checkout this package runs from (spec variants that are not shipped)."""
    return Path(__file__).resolve().parents[3] / "bench" / "specs"


def resolve_spec(spec: str) -> str:
    """A path, a shipped name (``qwen3``) or a bench variant (``qwen3_addnorm``) -> an existing path."""
    from patchdsl.util.resources import specs_dir

    p = Path(spec).expanduser()
    if p.is_file():
        return str(p)
    name = p.name if p.suffix == ".kpatch" else p.name + ".kpatch"
    for d in (specs_dir(), bench_specs_dir()):
        if (d / name).is_file():
            return str(d / name)
    known = sorted({q.stem for d in (specs_dir(), bench_specs_dir()) if d.is_dir() for q in d.glob("*.kpatch")})
    raise ValueError(f"spec {spec!r}: no such file, and no spec of that name in specs/ or bench/specs/ "
                     f"(known: {', '.join(known)})")


def plan_rows(o: E2EOptions) -> list[Row]:
    """Rows in the order they run: per batch size, the variants in the order given, a row per spec
    for the patched ones.  Raises ValueError for an unknown variant or spec."""
    bad = [v for v in o.variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    specs = [resolve_spec(s) for s in o.spec_list()] if any(v in PATCHED for v in o.variants) else []
    labels = [Path(s).stem for s in specs]
    if len(set(labels)) < len(labels):
        labels = [str(s) for s in specs]
    many_b = len(o.batch_list()) > 1
    rows = []
    for b in o.batch_list():
        suffix = f" @{b}x{o.seq}" if many_b else ""
        for v in o.variants:
            if v in PATCHED:
                for s, lab in zip(specs, labels):
                    name = v if len(specs) == 1 else f"{v}:{lab}"
                    rows.append(Row(name + suffix, v, s, lab, b))
            else:
                rows.append(Row(v + suffix, v, None, None, b))
    if not o.isolate:          # one process: Liger's rebinding of transformers' names must come last
        rows = [r for r in rows if r.variant != "liger"] + [r for r in rows if r.variant == "liger"]
    return rows


def filtered_spec(spec: str) -> tuple[str, list[str], str]:
    """The spec text with rules whose op is not registered yet removed; (text, dropped rules, path)."""
    from patchdsl.ops.registry import get_op

    path = resolve_spec(spec)
    text = Path(path).read_text()
    keep, dropped = [], []
    for line in text.splitlines():
        m = re.search(r"->\s*([A-Za-z_]\w*)", line.split("#", 1)[0])
        if m and get_op(m.group(1)) is None:
            dropped.append(line.strip())
            keep.append("# (not registered yet) " + line)
        else:
            keep.append(line)
    return "\n".join(keep) + "\n", dropped, path


# ----------------------------------------------------------------------------- one row, in this process
def build_model(o: E2EOptions):
    """(model, where it came from).  patchdsl.model.load_model when present, else the hyperparameters above."""
    import torch

    try:
        from patchdsl.model import load_model

        lm = load_model(o.model, dtype=torch_dtype(o.dtype), device=o.device, weights=False,
                        attn_implementation=o.attn, tiny=o.tiny, seed=o.seed, log=None)
        model, source = lm.model, lm.source
    except Exception as e:  # patchdsl.model missing or failing: the architecture from the constants
        from patchdsl.model.hf import build_model, default_config

        kw = dict(QWEN3_06B)
        if o.tiny:
            kw.update(TINY)
        cfg = default_config("qwen3", **kw)
        torch.manual_seed(o.seed)
        dev = torch.device(o.device)
        if dev.type == "cuda":
            torch.cuda.manual_seed_all(o.seed)
        with dev:
            model = build_model(cfg, dtype=torch_dtype(o.dtype), attn_implementation=o.attn)
        source = f"qwen3 from built-in hyperparameters ({type(e).__name__} from patchdsl.model: {e})"
    model.config.use_cache = False
    return model, source


def make_batches(vocab: int, o: E2EOptions, device: Any, batch: int | None = None) -> list[dict]:
    import torch

    batch = batch or o.batch
    g = torch.Generator().manual_seed(o.seed + 1)
    out = []
    for _ in range(o.warmup + o.steps):
        ids = torch.randint(0, vocab, (batch, o.seq), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


def _step(model, opt, batch: dict, micro: int):
    total = None
    n = batch["input_ids"].shape[0]
    for j in range(0, n, micro):
        ids = batch["input_ids"][j:j + micro]
        out = model(input_ids=ids, labels=batch["labels"][j:j + micro])
        loss = out.loss * (ids.shape[0] / n)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        del out, loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def train(model, batches: list[dict], o: E2EOptions, micro: int, graphed: bool = False) -> dict[str, Any]:
    """Train on ``batches`` (the first ``o.warmup`` are warm-up); ``graphed``: each step is a replay of
    one CUDA graph captured by ``patchdsl.graph_step`` before the first step."""
    import torch

    cuda = timing.is_cuda(o.device)
    batch = batches[0]["input_ids"].shape[0]
    model.train()
    extra: dict[str, Any] = {}
    if graphed:
        from patchdsl.training.graphs import graph_step

        if not cuda:
            raise ValueError("patchdsl+graphs needs --device cuda (CUDA graphs)")
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, fused=True, capturable=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tc = time.perf_counter()
        graphed_step = graph_step(model, opt, batches[0], micro_batch=micro if micro < batch else None)
        torch.cuda.synchronize()
        extra = {"capture_s": time.perf_counter() - tc, "capture_peak_bytes": int(torch.cuda.max_memory_allocated()),
                 "graphs": {"captures": graphed_step.captures, "patched_sites": graphed_step.patched_sites}}

        def step(b: dict):
            return graphed_step(b)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, fused=True if cuda else None)

        def step(b: dict):
            return _step(model, opt, b, micro)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses: list[Any] = []
    warm_s: list[float] = []
    t0 = time.perf_counter()
    t_meas = None
    for i, b in enumerate(batches):
        if i == o.warmup:
            timing.sync(o.device)
            t_meas = time.perf_counter()
        ts = time.perf_counter()
        losses.append(step(b))
        if i < o.warmup:
            timing.sync(o.device)
            warm_s.append(time.perf_counter() - ts)
    timing.sync(o.device)
    end = time.perf_counter()
    elapsed = end - (t_meas if t_meas is not None else t0)
    n = len(batches) - o.warmup
    res: dict[str, Any] = {
        "losses": [float(x) for x in losses], "warmup_step_s": warm_s,
        "step_ms": 1000 * elapsed / max(1, n), "tokens_per_s": n * batch * o.seq / elapsed if elapsed > 0 else 0.0,
        "micro_batch": micro, "grad_accum": -(-batch // micro), "measured_steps": n, "batch": batch, **extra}
    if cuda:
        res["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        res["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved())
        if graphed:       # the activations live in the graph's pool, which the allocator counts as free
            try:
                mem = graphed_step.memory()
                res.update(mem, peak_allocated_bytes=res["peak_bytes"])
                res["peak_bytes"] = res["peak_bytes"] + mem["pool_free_bytes"]
            except Exception as e:  # the snapshot format of another torch: the reserved peak, said so
                res["peak_bytes"] = res["reserved_peak_bytes"]
                res["peak_note"] = f"graph pool not measured ({type(e).__name__}: {e}); peak = max reserved"
        # the host's share: one more step issued after a sync, CPU time to issue it vs its GPU time
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        th = time.perf_counter()
        ev0.record()
        step(batches[-1])
        ev1.record()
        res["host_issue_ms"] = 1000 * (time.perf_counter() - th)
        torch.cuda.synchronize()
        res["host_step_wall_ms"] = 1000 * (time.perf_counter() - th)
        res["gpu_step_ms"] = float(ev0.elapsed_time(ev1))
    if graphed:
        graphed_step.close()
    del opt
    return res


def _compile(model, o: E2EOptions, how: str = "plain"):
    """``how``: plain ``torch.compile``, ``model`` (patchdsl.compile_model) or ``regional``
    (patchdsl.compile_layers, in place)."""
    import torch

    kw: dict[str, Any] = {"backend": o.compile_backend}
    if o.compile_mode:
        kw["mode"] = o.compile_mode
    if how == "model":
        from patchdsl.training.compile import compile_model

        return compile_model(model, **kw)
    if how == "regional":
        from patchdsl.training.compile import compile_layers

        compile_layers(model, **kw)
        return model
    return torch.compile(model, **kw)


def compile_stats() -> dict[str, Any]:
    """Dynamo's counters after the run: graph breaks (by reason), frames and graphs compiled, recompilations."""
    try:
        from torch._dynamo.utils import counters
    except Exception as e:  # pragma: no cover
        return {"error": _first_line(e)}
    breaks = dict(counters.get("graph_break", {}))
    return {"graph_breaks": int(sum(breaks.values())), "break_reasons": {str(k)[:200]: v for k, v in list(breaks.items())[:8]},
            "frames": int(counters.get("frames", {}).get("total", 0)),
            "frames_ok": int(counters.get("frames", {}).get("ok", 0)),
            "unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
            "recompiles": int(sum(counters.get("recompiles", {}).values())) if counters.get("recompiles") else 0}


def _prepare(variant: str, model, o: E2EOptions, spec: str | None = None) -> tuple[Any, dict]:
    """Patch / wrap ``model`` for ``variant``; returns (model to train, facts)."""
    info: dict[str, Any] = {}
    if variant == "hf":
        return model, info
    if variant in PATCHED:
        import patchdsl

        text, dropped, path = filtered_spec(spec or o.spec_list()[0])
        plan = patchdsl.plan(text, model, dtypes=(o.dtype,))
        handle = patchdsl.apply(plan, model)
        info.update({"spec": path, "dropped_rules": dropped, "patched_sites": len(handle.patched),
                     "refused": [str(r) for r in handle.refused],
                     "totals": [{"name": n, "patched": a, "present": b} for n, a, b in plan.totals]})
        how = {"patchdsl+compile": "model", "patchdsl+regional": "regional", "patchdsl+plain_compile": "plain"}.get(variant)
        if how is not None:
            info["compile"] = {"backend": o.compile_backend, "mode": o.compile_mode, "how": how}
            return _compile(model, o, how), info
        return model, info
    if variant == "compile":
        info["compile"] = {"backend": o.compile_backend, "mode": o.compile_mode}
        return _compile(model, o), info
    if variant == "liger":
        try:
            import liger_kernel.transformers as lt
        except Exception as e:
            raise ImportError(f"liger_kernel not importable: {e}") from None
        mt = getattr(model.config, "model_type", "")
        fn = getattr(lt, f"apply_liger_kernel_to_{mt}", None)
        if fn is not None:
            fn(model=model)
            info["liger_fn"] = fn.__name__
        else:
            lt._apply_liger_kernel_to_instance(model=model)
            info["liger_fn"] = "_apply_liger_kernel_to_instance"
        return model, info
    raise ValueError(f"unknown variant {variant!r}")


def _free(device: str) -> None:
    gc.collect()
    if timing.is_cuda(device):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0] if s else ''}"[:500]


def run_row(o: E2EOptions, row: Row, micro: int, snapshot: dict | None = None) -> dict[str, Any]:
    """Build, prepare and train one row in this process.  status: ok / oom / error."""
    import dataclasses

    import torch

    if row.variant in COMPILED and o.compile_warmup is not None:
        o = dataclasses.replace(o, warmup=o.compile_warmup)
    rec: dict[str, Any] = {"variant": row.name, "base": row.variant, "status": "ok"}
    if row.spec_label:
        rec["spec_label"] = row.spec_label
    model = None
    try:
        model, source = build_model(o)
        rec["model_source"] = source
        rec["model"] = _model_facts(model, o, row.batch)
        if snapshot is not None:
            model.load_state_dict(snapshot)
        vocab = model.config.vocab_size
        model, info = _prepare(row.variant, model, o, row.spec)
        rec.update(info)
        batches = make_batches(vocab, o, o.device, row.batch)
        rec.update(train(model, batches, o, micro, graphed=row.variant in GRAPHED))
        if row.variant in COMPILED:
            rec["compile_stats"] = compile_stats()
            rec["warmup_s"] = float(sum(rec.get("warmup_step_s", [])))
    except torch.cuda.OutOfMemoryError as e:
        rec.update(status="oom", error=_first_line(e), micro_batch=micro)
    except Exception as e:
        rec.update(status="error", error=_first_line(e), traceback=traceback.format_exc(limit=12)[-4000:],
                   micro_batch=micro)
    model = None
    _free(o.device)
    return rec


# ----------------------------------------------------------------------------- the worker process
def _package_root() -> str:
    """What the worker puts first on its path: the folders of this process's patchdsl and of these tools."""
    import patchdsl

    here = (Path(patchdsl.__file__).resolve().parents[1], Path(__file__).resolve().parents[2])
    return os.pathsep.join(dict.fromkeys(str(d) for d in here))


def worker_main(req_path: str, out_path: str) -> int:
    """``python -m patchdsl_tools.bench.e2e --worker REQUEST.json RESULT.json``: one row, result to RESULT.json."""
    req = json.loads(Path(req_path).read_text())
    o = E2EOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in req["options"].items()})
    row = Row(**req["row"])
    from patchdsl.codegen import ensure_triton
    from .runner import _finite, environment

    ensure_triton()
    rec = run_row(o, row, int(req["micro"]))
    try:
        rec["env"] = environment(o.device)
    except Exception as e:  # pragma: no cover - the record matters more than its environment
        rec["env"] = {"error": _first_line(e)}
    files.write_text(out_path, json.dumps(_finite(rec), indent=1), what="row record")
    return 0


_CURRENT: dict[str, Any] = {"proc": None}


def _kill(proc) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # the worker and whatever it started (compile workers)
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.kill()
        except Exception:
            pass


def run_process(cmd: list[str], timeout_s: float, prefix: str = "", tail_lines: int = 60,
                env: dict | None = None, echo: bool = True) -> dict[str, Any]:
    """Run ``cmd`` in its own session, forward its output (prefixed) to stderr, stop it after
    ``timeout_s``.  Returns {rc, timed_out, tail (last lines), wall_s}."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env, text=True, errors="replace", bufsize=1)
    _CURRENT["proc"] = proc
    tail: deque[str] = deque(maxlen=tail_lines)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if echo:
                print(prefix + line, end="", file=sys.stderr, flush=True)

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    timed_out = False
    try:
        proc.wait(timeout=max(0.1, timeout_s))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
        proc.wait()
    finally:
        _CURRENT["proc"] = None
    th.join(timeout=5)
    return {"rc": proc.returncode, "timed_out": timed_out, "tail": list(tail), "wall_s": time.perf_counter() - t0}


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "no exit status"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _error_from_tail(tail: list[str]) -> str:
    for line in reversed(tail):
        s = line.strip()
        if re.match(r"^[\w.]*(Error|Exception|error)\b", s) or "CUDA error" in s or "Segmentation fault" in s:
            return s[:400]
    return (tail[-1].strip()[:400] if tail else "")


def _worker_cmd(req: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "patchdsl_tools.bench.e2e", "--worker", str(req), str(out)]


def _spawn_row(o: E2EOptions, row: Row, micro: int, timeout_s: float, workdir: Path, idx: int) -> dict[str, Any]:
    req = workdir / f"row{idx}-mb{micro}.req.json"
    out = workdir / f"row{idx}-mb{micro}.out.json"
    opts = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(o).items()}
    opts.update(json_path=None, budget_s=1e9)
    files.write_text(req, json.dumps({"options": opts, "row": {k: v for k, v in asdict(row).items()}, "micro": micro}),
                     what="row request")
    env = dict(os.environ)
    root = _package_root()      # the worker imports the same patchdsl as this process
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    r = run_process(_worker_cmd(req, out), timeout_s, prefix=f"  [{row.name}] ", env=env, echo=not o.quiet)
    rec: dict[str, Any]
    if out.is_file():
        rec = json.loads(out.read_text())
    else:
        what = (f"timed out after {timeout_s:.0f} s" if r["timed_out"] else f"process died ({_describe_exit(r['rc'])})")
        err = _error_from_tail(r["tail"])
        rec = {"variant": row.name, "base": row.variant, "status": "error", "micro_batch": micro,
               "error": f"{what}: {err}" if err else what, "output_tail": "\n".join(r["tail"][-40:])}
        if row.spec_label:
            rec["spec_label"] = row.spec_label
    rec["process"] = {"rc": r["rc"], "timed_out": r["timed_out"], "wall_s": round(r["wall_s"], 2)}
    return rec


# ----------------------------------------------------------------------------- the run
class _Terminated(Exception):
    pass


def _on_term(signum, frame):
    _kill(_CURRENT.get("proc"))
    raise _Terminated(f"received {signal.Signals(signum).name}")


def run_e2e(o: E2EOptions) -> dict[str, Any]:
    from .runner import _finite, write_json

    t0 = time.perf_counter()
    rows = plan_rows(o)
    doc: dict[str, Any] = {"kind": KIND, "options": {k: (list(v) if isinstance(v, tuple) else v)
                                                     for k, v in asdict(o).items()},
                           "rows": [r.name for r in rows], "variants": [], "complete": False}
    doc["options"]["specs"] = sorted({r.spec for r in rows if r.spec})
    snapshot = None
    if o.isolate:
        import tempfile

        workdir = Path(tempfile.mkdtemp(prefix="patchdsl-e2e-"))
        doc["isolation"] = "a fresh process per row"
    else:
        workdir = None
        doc["isolation"] = "one process (rows one after another)"
        from patchdsl.codegen import ensure_triton

        ensure_triton()
        try:
            base, source = build_model(o)
        except Exception as e:
            doc["error"] = f"could not build the model: {type(e).__name__}: {e}"
            doc["traceback"] = traceback.format_exc(limit=6)
            write_json(o.json_path, _finite(doc))
            return _finite(doc)
        doc["model_source"] = source
        doc["model"] = _model_facts(base, o)
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()}
        del base
        _free(o.device)
    old = None
    if threading.current_thread() is threading.main_thread():
        old = (signal.signal(signal.SIGTERM, _on_term), signal.signal(signal.SIGINT, _on_term))
    _log(o, t0, f"{o.model}, {len(rows)} row(s): {', '.join(r.name for r in rows)}; "
                f"batch {'/'.join(map(str, o.batch_list()))} x {o.seq}; "
                + ("a fresh process per row" if o.isolate else "in this process"))
    current: list[Row] = []
    try:
        for idx, row in enumerate(rows):
            current[:] = [row]
            rec = _measure_row(o, row, idx, t0, workdir, snapshot)
            if o.isolate and "model" not in doc and rec.get("model"):
                doc["model"] = rec["model"]
            if o.isolate and "env" not in doc and rec.get("env") and "error" not in rec["env"]:
                doc["env"] = rec["env"]
            doc["variants"].append(rec)
            doc["elapsed_s"] = time.perf_counter() - t0
            doc["loss_reference"], doc["loss_agreement"] = _agreement(doc["variants"])
            write_json(o.json_path, _finite(doc))
            _log(o, t0, _line(rec))
        doc["complete"] = True
    except _Terminated as e:
        doc["terminated"] = str(e)
        done = {v["variant"] for v in doc["variants"]}
        for row in rows:
            if row.name in done:
                continue
            if current and row is current[0]:
                doc["variants"].append({"variant": row.name, "base": row.variant, "status": "error", "batch": row.batch,
                                        "error": f"stopped while running: the run was terminated ({e})"})
            else:
                doc["variants"].append({"variant": row.name, "base": row.variant, "status": "skipped", "batch": row.batch,
                                        "error": f"not started: the run was terminated ({e})"})
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old[0])
            signal.signal(signal.SIGINT, old[1])
        if workdir is not None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    if "env" not in doc:
        from .runner import environment

        try:
            doc["env"] = environment("cpu" if o.isolate else o.device)   # no CUDA context in the parent
            doc["env"]["device"] = o.device
        except Exception as e:  # pragma: no cover
            doc["env"] = {"error": _first_line(e)}
    doc["elapsed_s"] = time.perf_counter() - t0
    doc["loss_reference"], doc["loss_agreement"] = _agreement(doc["variants"])
    write_json(o.json_path, _finite(doc))
    return _finite(doc)


def _model_facts(model, o: E2EOptions, batch: int | None = None) -> dict[str, Any]:
    cfg = model.config
    return {"type": cfg.model_type, "name": o.model, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "params": int(sum(p.numel() for p in model.parameters())),
            "tokens_per_step": (batch or o.batch_list()[0]) * o.seq}


def _measure_row(o: E2EOptions, row: Row, idx: int, t0: float, workdir: Path | None,
                 snapshot: dict | None) -> dict[str, Any]:
    micro = min(o.micro_batch or row.batch, row.batch)
    tv = time.perf_counter()
    retries: list[str] = []
    while True:
        left = o.budget_s - (time.perf_counter() - t0)
        if left <= 1:
            rec = {"variant": row.name, "base": row.variant, "status": "skipped",
                   "error": f"time budget ({o.budget_s:.0f} s) spent"}
            break
        if workdir is not None:
            rec = _spawn_row(o, row, micro, min(o.variant_timeout_s, left), workdir, idx)
            if rec.get("process", {}).get("timed_out") and left < o.variant_timeout_s:
                rec["error"] = rec.get("error", "") + f" (stopped at the end of the time budget, {o.budget_s:.0f} s)"
        else:
            rec = run_row(o, row, micro, snapshot)
        if rec.get("status") != "oom":
            break
        retries.append(f"micro-batch {micro}: {rec.get('error', '')[:200]}")
        if not o.oom_retry or micro <= 1:
            rec["status"] = "error"
            rec["error"] = (f"out of memory at micro-batch {micro}"
                            + ("" if o.oom_retry else " (no retry: oom_retry off)") + f": {rec.get('error', '')}")
            break
        micro = max(1, micro // 2)
        _log(o, t0, f"{row.name}: out of memory; retrying with micro-batch {micro}")
    if retries:
        rec["oom_retries"] = retries
    rec.setdefault("batch", row.batch)
    if row.spec_label:
        rec.setdefault("spec_label", row.spec_label)
    rec["variant_s"] = time.perf_counter() - tv
    return rec


def _agreement(variants: list[dict]) -> tuple[str | None, dict[str, Any]]:
    """Loss differences of every row against the unpatched reference of the same batch size
    (``hf``, else ``compile``, else the first row that ran).  Returns (reference name, per row)."""
    ok = [v for v in variants if v.get("status") == "ok" and v.get("losses")]
    out: dict[str, Any] = {}
    refname = None
    for b in dict.fromkeys(v.get("batch") for v in ok):
        same = [v for v in ok if v.get("batch") == b]
        ref = next((v for base in UNPATCHED for v in same if v.get("base", v["variant"]) == base), None) or same[0]
        refname = refname or ref["variant"]
        for v in same:
            if v is ref:
                continue
            d = [abs(a - c) for a, c in zip(v["losses"], ref["losses"])]
            out[v["variant"]] = {"reference": ref["variant"], "first_step_abs_diff": d[0] if d else None,
                                 "max_abs_diff": max(d) if d else None,
                                 "max_rel_diff": max((x / abs(c) for x, c in zip(d, ref["losses"]) if c), default=None)}
        # compiled patched rows also against the eager patched row of the same spec (the compile's own error)
        for v in same:
            spec_eager = next((e for e in same if e.get("base") == "patchdsl" and e.get("spec_label") == v.get("spec_label")),
                              None)
            if v.get("base") in COMPILED and spec_eager is not None and spec_eager is not v:
                n = min(len(v["losses"]), len(spec_eager["losses"]))
                d = [abs(a - c) for a, c in zip(v["losses"][:n], spec_eager["losses"][:n])]
                out.setdefault(v["variant"], {})["vs_patchdsl_max_abs_diff"] = max(d) if d else None
    return refname, out


def _line(rec: dict) -> str:
    if rec["status"] != "ok":
        return f"{rec['variant']}: {rec['status']}: {rec.get('error', '')}"
    peak = rec.get("peak_bytes")
    mem = f", peak {peak / 2**30:.2f} GiB" if peak else ""
    host = f", host issues a step in {rec['host_issue_ms']:.1f} ms" if rec.get("host_issue_ms") is not None else ""
    if rec.get("capture_s") is not None:
        host += f", captured in {rec['capture_s']:.1f} s"
    if rec.get("compile_stats") is not None:
        cs = rec["compile_stats"]
        host += (f", warm-up {rec.get('warmup_s', 0):.1f} s, {cs.get('graph_breaks')} graph break(s), "
                 f"{cs.get('unique_graphs')} graph(s)")
    return (f"{rec['variant']}: {rec['tokens_per_s']:,.0f} tokens/s, {rec['step_ms']:.1f} ms/step{mem}{host}, "
            f"micro-batch {rec['micro_batch']}, losses {', '.join(f'{x:.4f}' for x in rec['losses'][:3])}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3]))
    print("usage: python -m patchdsl_tools.bench.e2e --worker REQUEST.json RESULT.json  (use `patchdsl bench e2e`)",
          file=sys.stderr)
    sys.exit(2)
