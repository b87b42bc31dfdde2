"""The ``patchdsl`` command line.  It only calls the pipeline's stages.

Exit codes: 0 success, 1 a check failed (verify), 2 bad input (spec or model errors).
Spec errors never print a Python traceback.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import click

from ._version import __version__
from . import files
from .files import FileReadError
from .syntax.errors import SpecError

# Exit codes, the same for every command (docs/reliability.md, "Exit codes"):
EXIT_OK = 0            # the command did what was asked
EXIT_FAILED = 1        # verify: a comparison against the float64 reference failed
EXIT_BAD_INPUT = 2     # the input is unusable: spec, model, options, files, or a required site refused


class UsageFailure(Exception):
    """Bad input that is not a spec error (unknown model, unreadable file): exit 2."""


def _console(stderr: bool = False):
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal:
        c = Console(stderr=stderr, highlight=False, width=160)
    return c


def _fail(msg: str) -> None:
    click.echo(msg, err=True)
    sys.exit(EXIT_BAD_INPUT)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecError as e:
            _fail(e.render())
        except UsageFailure as e:
            _fail(f"error: {e}")
        except FileNotFoundError as e:
            _fail(f"error: {e}")
        except FileReadError as e:           # an untrusted file that cannot be read (patchdsl.files)
            _fail(f"error: {e}")
        except Exception as e:
            # bad data that is not a spec error: a plan file, an unusable kernel cache, a value
            # that cannot go into generated code, a model the plan does not fit
            from .codegen import CacheError, CodegenError
            from .planner import PlanError
            from .runtime import PatchError

            if isinstance(e, (CacheError, CodegenError, PlanError, PatchError)):
                _fail(f"error: {e}")
            raise


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="patchdsl")
def main() -> None:
    """Declarative fused Triton kernels for Hugging Face transformers models.

    SPEC, wherever a command takes one, is a path to a .kpatch file or the name of a shipped spec
    (qwen3, llama, mistral, qwen2, gemma3, phi3).  Exit status: 0 success, 1 a verification failed,
    2 bad input (spec, model, options).
    """


def _read_spec(path: str):
    """SPEC (a file or a shipped spec's name), its includes expanded; SpecError (exit 2) if bad.
    Folders given with ``--include-dir`` may be read by its includes."""
    from .check import check_loaded
    from .syntax.parser import read_spec

    ctx = click.get_current_context(silent=True)
    dirs = ctx.meta.get("patchdsl.include_dirs", ()) if ctx is not None else ()
    return check_loaded(lambda: read_spec(path, include_dirs=dirs)).spec


def include_dir_option(f):
    """``--include-dir DIR`` (repeatable), stored for :func:`_read_spec` (not a parameter of f)."""
    def store(ctx, _param, value):
        ctx.meta["patchdsl.include_dirs"] = tuple(value)

    return click.option("--include-dir", multiple=True, expose_value=False, callback=store,
                        type=click.Path(file_okay=False, exists=True),
                        help="A folder that `include` may read besides the spec's own folder and the "
                             "shipped specs (repeatable).")(f)


def _load_model(model: str, *, meta: bool, dtype: str | None = None, device: str = "cpu", log=None, tiny=False,
                seed: int = 0):
    from .models import ModelLoadError, load_model

    try:
        return load_model(model, meta=meta, dtype=dtype, device=device, log=log or (lambda m: click.echo(m, err=True)),
                          tiny=tiny, seed=seed)
    except ModelLoadError as e:
        raise UsageFailure(str(e)) from None


# ---------------------------------------------------------------- check
@main.command()
@click.argument("spec")
@click.option("--json", "as_json", is_flag=True, help="Print the checked rules as JSON.")
@include_dir_option
def check(spec: str, as_json: bool) -> None:
    """Check a spec's syntax, ops, flags and kinds (no model needed)."""
    from .check import check_spec

    checked = check_spec(_read_spec(spec))
    if as_json:
        out = {"spec": spec, "ok": True, "dtypes": list(checked.spec.dtypes), "rules": [
            {"rule": cr.rule.span.short, "text": cr.rule.text, "op": cr.op, "optional": cr.rule.optional,
             "flags": {k: v.value for k, v in cr.explicit}} for cr in checked.rules]}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"{spec}: ok ({len(checked.rules)} rule(s), dtypes {', '.join(checked.spec.dtypes) or 'from the model'})")


# ---------------------------------------------------------------- plan
def _plan(spec: str, model: str, dtype: str | None, target: str | None, tiny: bool = False):
    from .planner import plan as make_plan

    sp = _read_spec(spec)
    loaded = _load_model(model, meta=True, tiny=tiny)
    dts = (dtype,) if dtype else None
    return make_plan(sp, loaded.model, target=target, dtypes=dts), loaded


def _fmt_flags(site) -> str:
    parts = []
    for k, v in site.flags:
        src = dict(site.flag_sources).get(k, "")
        if src == "op default":
            continue
        v = "true" if v is True else "false" if v is False else v
        parts.append(f"{k}={v}")
    return ", ".join(parts)


def print_plan(p, console=None) -> None:
    from rich.table import Table

    console = console or _console()
    t = Table(title=f"patch plan: {p.spec} on {p.model_class} ({p.target}; {', '.join(p.dtypes)})")
    for col in ("path", "class", "op", "flags", "rule", "matched by"):
        t.add_column(col, overflow="fold")
    for s in p.sites:
        op = f"{s.op}\n  from {s.source}" if s.source and s.op != "hub" else (s.source if s.source else s.op)
        if s.refused:
            op += " [yellow](refused)[/yellow]"
        flags = _fmt_flags(s) if s.op != "hub" else ""    # hub's flags are its source, shown in the op column
        t.add_row(s.path or "<model>", s.cls, op, flags, ", ".join(s.rules), s.matched_by)
        for c in s.covers:
            t.add_row(f"  {c}", p.infos[c].cls if c in p.infos else "", f"(fused into {s.op})", "", s.rule, "covered")
    console.print(t)
    for name, patched, present in p.totals:
        console.print(f"{patched}/{present} {name} patched")
    for u in p.unmatched_optional:
        console.print(f"optional rule matched nothing: {u}")
    shown: dict[tuple[str, str, str], list[str]] = {}
    for s in p.refused_sites:
        shown.setdefault((s.rule, s.op, s.refused), []).append(s.path or "<model>")
    for (rule, op, reason), paths in shown.items():
        where = paths[0] if len(paths) == 1 else f"{len(paths)} sites ({paths[0]}, ...)"
        console.print(f"[yellow]{rule}: refused {op} on {where}: {reason}[/yellow]", markup=True)
    if p.attention is not None:
        console.print(f"attention implementation: {p.attention.impl} (this model instance only; {p.attention.span})")
    ext = p.external_sites()
    n_ok = sum(1 for s in p.sites if not s.refused)
    console.print(f"{n_ok} site(s) to patch, {len(p.sites) - n_ok} refused, {len(p.kernel_keys())} kernel(s) to generate"
                  + (f", {len(ext)} site(s) with external kernels" if ext else ""))


@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), help="Override the spec's dtype directive.")
@click.option("--target", type=click.Choice(["cuda", "interpreter"]), help="Kernel target (default: detected).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@include_dir_option
def plan(spec: str, model: str, dtype: str | None, target: str | None, as_json: bool) -> None:
    """Resolve SPEC against a model's module tree and print what would be patched."""
    p, _ = _plan(spec, model, dtype, target)
    if as_json:
        click.echo(p.dumps())
    else:
        print_plan(p)


# ---------------------------------------------------------------- codegen
@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Folder for the generated kernels.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), help="Override the spec's dtype directive.")
@click.option("--target", type=click.Choice(["cuda", "interpreter"]),
              help="Kernel target (default: cuda with a GPU, else the Triton interpreter).")
@include_dir_option
def codegen(spec: str, model: str, out: str, dtype: str | None, target: str | None) -> None:
    """Write every kernel the plan needs into OUT, for reading."""
    from .codegen.cache import write_kernel

    p, _ = _plan(spec, model, dtype, target)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageFailure(f"cannot create '{out}': {e.strerror or e}") from None
    for key in p.kernel_keys():
        path = write_kernel(key, Path(out), flat=True)
        click.echo(f"wrote {path}")


# ---------------------------------------------------------------- apply
_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


def _device(device: str | None) -> str:
    """``--device`` checked against this machine: cpu, cuda or cuda:N (exit 2 otherwise)."""
    import torch

    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not _DEVICE.fullmatch(device):
        raise UsageFailure(f"--device {device[:40]!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise UsageFailure(f"--device {device}: {why}; use --device cpu (kernels then run in Triton's interpreter)")
        n = torch.cuda.device_count()
        if ":" in device and int(device.split(":")[1]) >= n:
            raise UsageFailure(f"--device {device}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return device


def _finite(ctx, param, value):
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


# upper bounds of the workload options (far above what a run of apply / verify takes)
MAX_BATCH, MAX_SEQ, MAX_STEPS = 65536, 1 << 20, 100_000
SEED = click.IntRange(0, 2 ** 63 - 1)


@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--steps", type=click.IntRange(1, MAX_STEPS), help="Measured training steps (default: 3 on CPU, 20 on GPU).")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), help="Batch size (default: 1 on CPU, 16 on GPU).")
@click.option("--seq", type=click.IntRange(2, MAX_SEQ), help="Sequence length (default: 16 on CPU, 2048 on GPU).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), help="Model dtype (default: bf16 on GPU, fp32 on CPU).")
@click.option("--device", help="cpu or cuda[:N] (default: cuda when available).")
@click.option("--tiny/--full", default=None, help="Shrink the architecture (default: tiny on CPU, full on GPU).")
@click.option("--lr", type=click.FloatRange(0, 10, min_open=True), default=1e-4, show_default=True, callback=_finite,
              help="AdamW learning rate of both runs.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and the batches.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the numbers to this JSON file.")
@include_dir_option
def apply(spec, model, steps, batch, seq, dtype, device, tiny, lr, seed, json_out) -> None:
    """Patch a model and train it twice (unpatched, patched) side by side."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .planner import plan as make_plan
    from .workload import Workload, compare_runs

    console = _console()
    if json_out and files.exists(json_out) and not files.is_file(json_out):
        raise UsageFailure(f"--json {files.show(json_out)}: not a regular file (a FIFO or a device would block or "
                           f"swallow the results)")
    device = _device(device)
    on_gpu = device.startswith("cuda")
    dtype = dtype or ("bf16" if on_gpu else "fp32")
    tiny = (not on_gpu) if tiny is None else tiny
    d = Workload.default(device)
    w = Workload(steps or d.steps, batch or d.batch, seq or d.seq, lr, seed, d.warmup)
    sp = _read_spec(spec)
    torch.manual_seed(seed)
    loaded = _load_model(model, meta=False, dtype=dtype, device=device, tiny=tiny, seed=seed)
    if tiny:
        console.print(f"[dim]CPU workload: tiny {loaded.model.config.model_type} architecture "
                      f"(hidden {loaded.model.config.hidden_size}, {loaded.model.config.num_hidden_layers} layers); "
                      f"pass --full for the real sizes[/dim]")
    p = make_plan(sp, loaded.model, dtypes=(dtype,))
    print_plan(p, console)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        kt = prog.add_task("generating kernels", total=len(p.kernel_keys()))
        from .codegen import load_kernel

        for key in p.kernel_keys():
            load_kernel(key)
            prog.advance(kt)

        def bar(label, total):
            t = prog.add_task(f"training {label}", total=total)
            return lambda n: prog.advance(t, n)

        ref, pat, handle = compare_runs(loaded.model, p, w, bar)
    for r in handle.refused:
        console.print(f"[yellow]{r}[/yellow]")
    t = Table(title=f"{w.steps} steps, batch {w.batch} x {w.seq}, {dtype}, {device}")
    t.add_column("step", justify="right")
    t.add_column("loss unpatched", justify="right")
    t.add_column("loss patched", justify="right")
    t.add_column("diff", justify="right")
    for i, (a, b) in enumerate(zip(ref.losses, pat.losses)):
        t.add_row(str(i + 1), f"{a:.5f}", f"{b:.5f}", f"{b - a:+.2e}")
    console.print(t)
    s = Table(show_header=True)
    s.add_column("")
    s.add_column("unpatched", justify="right")
    s.add_column("patched", justify="right")
    s.add_column("ratio", justify="right")
    s.add_row("tokens/s", f"{ref.tokens_per_s:,.0f}", f"{pat.tokens_per_s:,.0f}",
              f"{pat.tokens_per_s / ref.tokens_per_s:.2f}x" if ref.tokens_per_s else "-")
    s.add_row("step time", f"{ref.step_ms:.1f} ms", f"{pat.step_ms:.1f} ms", "")
    if ref.peak_mem_bytes is not None:
        gib = 2 ** 30
        s.add_row("peak memory", f"{ref.peak_mem_bytes / gib:.2f} GiB", f"{pat.peak_mem_bytes / gib:.2f} GiB",
                  f"{pat.peak_mem_bytes / ref.peak_mem_bytes:.2f}x")
    else:
        s.add_row("peak memory", "n/a on CPU", "n/a on CPU", "")
    console.print(s)
    if not on_gpu:
        console.print("[dim]On the CPU the kernels run in Triton's interpreter, so the patched run is slower: "
                      "compare losses here, speed on a GPU.[/dim]")
    from .planner import count_totals

    live = [s if s.path in handle.patched else replace(s, refused=s.refused or "refused at apply") for s in p.sites]
    present = {n: pr for n, _, pr in p.totals}
    totals = count_totals(live, present)
    console.print(f"patched {len(handle.patched)} site(s), refused {len(handle.refused)}; "
                  + "; ".join(f"{pt}/{pr} {n}" for n, pt, pr in totals))
    if json_out:
        Path(json_out).write_text(json.dumps({
            "spec": spec, "model": model, "device": device, "dtype": dtype, "tiny": tiny,
            "workload": {"steps": w.steps, "batch": w.batch, "seq": w.seq, "lr": w.lr, "seed": w.seed},
            "unpatched": ref.to_json(), "patched": pat.to_json(),
            "patched_sites": len(handle.patched), "refused": [str(r) for r in handle.refused],
            "totals": [{"name": n, "patched": a, "present": b} for n, a, b in totals]}, indent=2))
    handle.undo()
    if handle.refused_required:
        sys.exit(EXIT_BAD_INPUT)


# ---------------------------------------------------------------- verify
@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Dtype of the model under test (the reference runs in float64).")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), default=2, show_default=True,
              help="Batch size of the verification inputs.")
@click.option("--seq", type=click.IntRange(2, MAX_SEQ), default=16, show_default=True,
              help="Sequence length of the verification inputs.")
@click.option("--steps", type=click.IntRange(0, MAX_STEPS), default=0, show_default=True,
              help="Also compare N optimizer steps.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and inputs.")
@click.option("--device", help="cpu or cuda (default: cuda when available).")
@click.option("--tiny/--full", default=None, help="Shrink the architecture (default: tiny on CPU, full on GPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--progress", is_flag=True, help="Say on stderr what runs, with elapsed seconds.")
@include_dir_option
def verify(spec, model, dtype, batch, seq, steps, seed, device, tiny, as_json, progress) -> None:
    """Prove gradient parity of the patched model against a float64 reference."""
    from .parity import verify as run_verify

    device = _device(device)
    tiny = (not device.startswith("cuda")) if tiny is None else tiny
    sp = _read_spec(spec)

    def factory():
        import torch

        torch.manual_seed(seed)
        return _load_model(model, meta=False, dtype="fp32", device="cpu", tiny=tiny, seed=seed,
                           log=lambda m: None).model

    _load_model(model, meta=True, tiny=tiny)   # validate the model id early (exit 2) and say where it came from
    t0 = time.perf_counter()

    def say(m: str) -> None:
        click.echo(f"[verify {time.perf_counter() - t0:7.1f}s] {m}", err=True)

    report = run_verify(sp, factory, dtype=dtype, batch=batch, seq=seq, steps=steps, seed=seed, device=device,
                        log=say if progress else None)
    if progress:
        say("done")
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, default=str))
    else:
        report.render_table(_console())
    sys.exit(report.exit_code())


# ---------------------------------------------------------------- translate
@main.command()
@click.option("--liger", "liger", metavar="JSON|@FILE",
              help="Liger-Kernel's liger_kernel_config as JSON ('{\"rope\": true, ...}'), 'true' for "
                   "use_liger_kernel with Liger's defaults, or @file (JSON or YAML; a training config's "
                   "use_liger_kernel / liger_kernel_config keys are read).")
@click.option("--kernel-mapping", "kernel_mapping", type=click.Path(dir_okay=False),
              help="A transformers KernelConfig kernel_mapping as JSON: {\"RMSNorm\": \"org/repo:Layer\", ...}.")
@click.option("--model", "-m", help="Hub id, local folder, or path to config.json (the spec is written for it).")
@click.option("--device", default="cuda", show_default=True,
              help="With --kernel-mapping: which entry of per-device mapping values to take.")
def translate(liger: str | None, kernel_mapping: str | None, model: str | None, device: str) -> None:
    """Print the spec equivalent to another tool's kernel settings (--liger or --kernel-mapping) for --model."""
    if (liger is None) == (kernel_mapping is None):
        raise UsageFailure("say what to translate: --liger JSON|@FILE or --kernel-mapping FILE.json")
    if model is None:
        raise UsageFailure("translate needs --model M: the spec depends on the model's modules")
    if kernel_mapping:
        from .translate import MappingError, load_mapping, translate as run_translate

        try:
            mapping = load_mapping(kernel_mapping)
        except FileReadError as e:
            raise UsageFailure(str(e) if e.reason in ("missing", "os", "not-regular", "too-large")
                               else f"cannot read the kernel mapping: {e}") from None
        loaded = _load_model(model, meta=True)
        try:
            click.echo(run_translate(mapping, loaded.model, device=device, source=kernel_mapping), nl=False)
        except MappingError as e:
            raise UsageFailure(f"{kernel_mapping}: {e}") from None
        return
    from .index import build_index
    from .integrations.liger import parse_liger_argument, translate_liger

    use, cfg = parse_liger_argument(liger)
    loaded = _load_model(model, meta=True, log=lambda m: None)
    t = translate_liger(cfg, build_index(loaded.model), use_liger_kernel=use)
    if t.problems:
        for pr in t.problems:
            click.echo(f"error: {pr}", err=True)
        _fail("hint: turn those keys off (false) in the Liger config; patchdsl does not drop them silently")
    click.echo(t.text, nl=False)


# ---------------------------------------------------------------- inspect / suggest / census
@main.command("inspect")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--all", "everything", is_flag=True, help="Every module, not only norms, MLPs, attention and the LM head.")
@click.option("--no-fold", "no_fold", is_flag=True, help="One row per module (repeated layers are folded by default).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def inspect_cmd(model: str, everything: bool, no_fold: bool, as_json: bool) -> None:
    """List a model's modules with their structural kinds and facts (sizes, eps, offset, activation, rotary)."""
    from .index import build_index
    from .inspection import inspect_model, render

    loaded = _load_model(model, meta=True, log=lambda m: None)
    index = build_index(loaded.model)
    if as_json:
        click.echo(json.dumps(inspect_model(index, everything=everything, fold=not no_fold), indent=2, default=str))
    else:
        click.echo(render(index, everything=everything, fold=not no_fold), nl=False)


@main.command("suggest")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--out", "out", type=click.Path(dir_okay=False), help="Write the spec to this file (default: print it).")
def suggest_cmd(model: str, out: str | None) -> None:
    """Print the spec that patches everything patchdsl can on a model, with the reason for each module it cannot."""
    from .suggestion import suggest as run_suggest

    loaded = _load_model(model, meta=True, log=lambda m: None)
    s = run_suggest(loaded.model, name=model)
    if out:
        try:
            Path(out).write_text(s.text)
        except OSError as e:
            raise UsageFailure(f"cannot write '{out}': {e.strerror or e}") from None
        a = s.counts()
        click.echo(f"wrote {out}: " + "; ".join(f"{p}/{n} {c}" for c, (p, n) in a.items() if n), err=True)
    else:
        click.echo(s.text, nl=False)


@main.command("census")
@click.argument("families", nargs=-1)
@click.option("--no-verify", "no_verify", is_flag=True, help="Suggest and plan only (fast); the verify column says '-'.")
@click.option("--out", "out", default="docs/coverage.md", show_default=True,
              help="The table's file ('-' prints it).")
@click.option("--sample", is_flag=True, help="Only the families CI checks (patchdsl.census.CI_SAMPLE).")
def census_cmd(families, no_verify: bool, out: str, sample: bool) -> None:
    """Coverage census: every causal-LM family of the installed transformers (or FAMILIES), tiny config, suggest, plan, verify."""
    from .census import main as census_main

    args = list(families) + (["--no-verify"] if no_verify else []) + ["--out", out] + (["--sample"] if sample else [])
    sys.exit(census_main(args))


# ---------------------------------------------------------------- bench
@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
              add_help_option=False)
@click.pass_context
def bench(ctx) -> None:
    """Benchmarks (GPU): ops, e2e, specialise, summary, plot; `patchdsl bench SUB --help` for each.

    \b
    patchdsl bench ops         per-op time and memory against HF eager, torch.compile, Liger, CCE
    patchdsl bench e2e         end-to-end training throughput, variants side by side
    patchdsl bench specialise  specialised vs generic kernels
    patchdsl bench summary F   print the tables of a results JSON again
    patchdsl bench plot F      plot a results JSON
    Results go into --out, else $OUT, else a new bench-results/<command>-<time>/ folder.
    """
    from .bench.cli import run as bench_run

    sys.exit(bench_run(ctx.args))


if __name__ == "__main__":  # pragma: no cover
    main()
