"""The commands that run a patched model: apply (train unpatched and patched side by side) and verify."""

from __future__ import annotations

import json
import sys
import time

import click

from ..util import files
from .app import (DTYPE_CHOICE, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, MAX_BATCH, MAX_SEQ, MAX_STEPS, SEED, UsageFailure,
                  _console, _default_dtype, _device, _finite, _load_model, _read_spec, include_dir_option, json_option,
                  main)
from .commands import print_plan



# ---------------------------------------------------------------- apply
@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--steps", type=click.IntRange(1, MAX_STEPS), help="Measured training steps (default: 3 on CPU, 20 on GPU).")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), help="Batch size (default: 1 on CPU, 16 on GPU).")
@click.option("--seq", type=click.IntRange(2, MAX_SEQ), help="Sequence length (default: 16 on CPU, 2048 on GPU).")
@click.option("--dtype", type=DTYPE_CHOICE, help="Model dtype (default: bf16 on GPU, fp32 on CPU, as verify).")
@click.option("--device", help="cpu or cuda[:N] (default: cuda when available).")
@click.option("--tiny/--full", default=None, help="Shrink the architecture (default: tiny on CPU, full on GPU).")
@click.option("--lr", type=click.FloatRange(0, 10, min_open=True), default=1e-4, show_default=True, callback=_finite,
              help="AdamW learning rate of both runs.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and the batches.")
@json_option
@click.option("--json-out", "json_out", metavar="FILE",
              help="Also write the JSON document to this file.")
@include_dir_option
def apply(spec, model, steps, batch, seq, dtype, device, tiny, lr, seed, as_json, json_out) -> None:
    """Patch a model and train it twice (unpatched, patched) side by side.

    Prints the plan (a line per rule), the loss of every measured step of both runs and, on a GPU,
    tokens/s, step time and peak memory.  On the CPU the kernels run in Triton's interpreter, so
    no speed is reported there: compare losses on the CPU, speed on a GPU.
    """
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..planning import text as plantext
    from ..planning.planner import plan as make_plan
    from ..training.workload import Workload, measured_steps, side_by_side

    t_start = time.perf_counter()
    console = _console(stderr=as_json)        # with --json, stdout carries the document only

    def say(line: str = "") -> None:
        click.echo(line, err=as_json)

    if json_out:     # before the runs: a FIFO, a device, a folder or an unwritable file is refused now
        files.check_writable(json_out, what="--json-out")
    device = _device(device)
    on_gpu = device.startswith("cuda")
    dtype = dtype or _default_dtype(device)
    tiny = (not on_gpu) if tiny is None else tiny
    d = Workload.default(device)
    w = Workload(steps or d.steps, batch or d.batch, seq or d.seq, lr, seed, d.warmup)
    sp = _read_spec(spec)

    def stage(what: str) -> None:         # progress on stderr, with the time since apply started
        click.echo(f"[apply {time.perf_counter() - t_start:7.1f}s] {what}", err=True)

    if not tiny:
        # at full size: say what it will take and refuse at once when that does not fit (not minutes later)
        from ..model.memory import MemoryTooSmall, check_fits
        from ..training.workload import memory_need

        meta_model = _load_model(model, meta=True, dtype=dtype, log=lambda m: None).model
        need, how = memory_need(meta_model, dtype, w, device)
        del meta_model
        try:
            stage(check_fits(need, device, f"apply at full size ({how}, batch {w.batch} x {w.seq}, {dtype})",
                             hint="--tiny (the default on a CPU) trains a tiny model of the same architecture"))
        except MemoryTooSmall as e:
            raise UsageFailure(str(e)) from None
    stage("building the model")
    torch.manual_seed(seed)
    loaded = _load_model(model, meta=False, dtype=dtype, device=device, tiny=tiny, seed=seed)
    if tiny:
        tc = loaded.model.config.get_text_config()      # a vision-language model: its language tower
        say(f"CPU workload: tiny {loaded.model.config.model_type} architecture "
            f"(hidden {tc.hidden_size}, {tc.num_hidden_layers} layers); "
            f"pass --full for the real sizes")
    stage("planning")
    p = make_plan(sp, loaded.model, dtypes=(dtype,))
    print_plan(p, err=as_json)
    stage(f"generating {len(p.kernel_keys())} kernel(s)")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as prog:
        kt = prog.add_task("generating kernels", total=len(p.kernel_keys()))
        from ..codegen import load_kernel

        for key in p.kernel_keys():
            load_kernel(key)
            prog.advance(kt)

        def bar(label, total):
            # the bar counts the measured steps, as the table does; the warm-up steps before them
            # show as "(warm-up)" in the description and are not counted
            warm = total - w.steps
            t = prog.add_task(f"training {label} (warm-up)" if warm > 0 else f"training {label}", total=w.steps)
            seen = [0]

            def advance(n):
                before = seen[0]
                seen[0] += n
                counted = measured_steps(before, seen[0], warm)
                if before < warm <= seen[0]:
                    prog.update(t, description=f"training {label}")
                if counted:
                    prog.advance(t, counted)
            return advance

        run = side_by_side(loaded.model, p, w, dtype=dtype, device=device, seed=seed, progress_factory=bar,
                           stage=stage)
    ref, pat, handle = run.unpatched, run.patched, run.handle
    total_s = time.perf_counter() - t_start
    for r in handle.refused:
        say(click.style(str(r), fg="yellow"))
    if not run.trained:
        say("not trained: the parity verdict below failed before training, so neither run was started "
            "(`patchdsl verify SPEC --model M` shows every check)")
    else:
        _print_runs(say, w, dtype, device, ref, pat, on_gpu)
    totals, fused, parity = run.totals, run.fused, run.parity
    if run.trained:
        say(f"patched {len(handle.patched)} site(s)" + (f" (+{fused} module(s) fused into them)" if fused else "")
            + f", refused {len(handle.refused)}; " + "; ".join(f"{pt}/{pr} {n}" for n, pt, pr in totals))
    say(f"parity: {'passed' if parity['passed'] else 'FAILED'} -- {parity['verdict']}")
    click.echo(f"apply took {total_s:.1f} s in all", err=True)
    code = EXIT_BAD_INPUT if run.refused_required else (EXIT_OK if run.passed else EXIT_FAILED)
    doc = {"ok": code == EXIT_OK, "exit_code": code,
           "spec": spec, "model": model, "device": device, "dtype": dtype, "tiny": tiny, **run.to_json(on_gpu),
           "total_s": round(total_s, 2)}
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    if json_out:
        files.write_text(json_out, json.dumps(doc, indent=2, default=str), what="--json-out")
    handle.undo()
    if code != EXIT_OK:
        sys.exit(code)


def _print_runs(say, w, dtype, device, ref, pat, on_gpu) -> None:
    """apply's loss table (and on a GPU its speed table) of the two runs."""
    from ..planning import text as plantext

    say(f"{w.steps} steps, batch {w.batch} x {w.seq}, {dtype}, {device}")
    rows = [[str(i + 1), f"{a:.5f}", f"{b:.5f}", f"{b - a:+.2e}"] for i, (a, b) in enumerate(zip(ref.losses, pat.losses))]
    for line in plantext.columns(["step", "loss unpatched", "loss patched", "diff"], rows, right=(0, 1, 2, 3)):
        say(line)
    if on_gpu:
        gib = 2 ** 30
        speed = [["tokens/s", f"{ref.tokens_per_s:,.0f}", f"{pat.tokens_per_s:,.0f}",
                  f"{pat.tokens_per_s / ref.tokens_per_s:.2f}x" if ref.tokens_per_s else "-"],
                 ["step time", f"{ref.step_ms:.1f} ms", f"{pat.step_ms:.1f} ms",
                  f"{pat.step_ms / ref.step_ms:.2f}x" if ref.step_ms else "-"]]
        if ref.peak_mem_bytes is not None and pat.peak_mem_bytes is not None:
            speed.append(["peak memory", f"{ref.peak_mem_bytes / gib:.2f} GiB", f"{pat.peak_mem_bytes / gib:.2f} GiB",
                          f"{pat.peak_mem_bytes / ref.peak_mem_bytes:.2f}x" if ref.peak_mem_bytes else "-"])
        for line in plantext.columns(["", "unpatched", "patched", "ratio"], speed, right=(1, 2, 3)):
            say(line)
    else:
        say("speed: not reported on the CPU (the patched kernels run in Triton's interpreter, so tokens/s and "
            "step times say nothing about them); compare losses here, speed on a GPU")


# ---------------------------------------------------------------- verify
@main.command()
@click.argument("spec")
@click.option("--model", "-m", required=True, help="Hub id, local folder with config.json, or path to a config.json (no weights: random, built from the config).")
@click.option("--dtype", type=DTYPE_CHOICE,
              help="Dtype of the model under test (default: bf16 on GPU, fp32 on CPU, as apply); the reference "
                   "runs in float64.")
@click.option("--batch", type=click.IntRange(1, MAX_BATCH), default=2, show_default=True,
              help="Batch size of the verification inputs.")
@click.option("--seq", type=click.IntRange(2, MAX_SEQ), default=16, show_default=True,
              help="Sequence length of the verification inputs.")
@click.option("--steps", type=click.IntRange(0, MAX_STEPS), default=0, show_default=True,
              help="Also compare N optimizer steps.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the weights and inputs.")
@click.option("--device", help="cpu or cuda[:N] (default: cuda when available).")
@click.option("--tiny/--full", default=None, help="Shrink the architecture (default: tiny on CPU, full on GPU).")
@click.option("--layers", type=click.IntRange(1, 100_000),
              help="Keep N decoder layers, at least one of each layer type (full / linear / sliding attention, "
                   "dense / MoE): a quick check of a large model at its real widths; only the kept layers are "
                   "built, and the output says which original layers were kept.")
@click.option("--reference", type=click.Choice(["auto", "whole", "streamed"]), default="auto", show_default=True,
              help="The float64 reference: a copy of the whole model, or streamed one decoder layer at a time "
                   "(for models whose float64 copy does not fit); auto picks by a memory estimate.")
@click.option("--images/--text-only", "images", default=None,
              help="Vision-language models: feed an image batch built from the config, so the vision tower runs "
                   "and its sites are judged (default: images when a batch runs, else text only with the "
                   "reason; --images fails with the reason instead), or text only.")
@click.option("--tp", type=click.IntRange(2, 64), default=None,
              help="Check a parallel run instead: N gloo processes on this machine train the family's tiny model "
                   "parallelised (--tp-layout) and patched, against the single-process model (every step's loss "
                   "and every final parameter; --steps, default 3).")
@click.option("--tp-layout", type=click.Choice(["tp", "hf_tp", "tp_sp", "fsdp_tp", "ep"]), default="tp",
              show_default=True,
              help="With --tp: tensor parallelism (parallelize_module), transformers' own TP styles, + sequence "
                   "parallelism, FSDP2 + TP on an (N/2, 2) mesh, or transformers' expert parallelism.")
@json_option
@click.option("--progress", is_flag=True, help="Say on stderr what runs, with elapsed seconds.")
@include_dir_option
def verify(spec, model, dtype, batch, seq, steps, seed, device, tiny, layers, reference, images, tp, tp_layout,
           as_json, progress) -> None:
    """Prove gradient parity of the patched model against a float64 reference."""
    from ..parity import verify as run_verify
    from ..parity.stream import VerifyError, build_dtype

    if tp is not None:
        _verify_parallel(spec, model, tp, tp_layout, steps or 3, as_json)
        return

    device = _device(device)
    dtype = dtype or _default_dtype(device)
    tiny = (not device.startswith("cuda")) if tiny is None else tiny
    sp = _read_spec(spec)
    told = []
    # validate the model id early (exit 2) and say where it came from
    # --layers N: the layers kept (one of each type at least) are chosen on the meta device, and only
    # those are ever built (a 671B config with --layers 2 allocates two layers)
    meta = _load_model(model, meta=True, tiny=tiny, log=lambda m: None, layers=layers).model   # quietly
    # on a GPU the model is built there (in fp32 when the whole float64 model fits beside it, else in the
    # run dtype: the reference then evaluates exactly the weights under test); on the CPU in fp32
    try:
        build_dt, build_dev = (("fp32", "cpu") if tiny or not device.startswith("cuda") else
                               (build_dtype(meta, dtype, batch, seq, steps, device, reference, layers), device))
    except VerifyError as e:
        raise UsageFailure(str(e)) from None
    if not tiny and not device.startswith("cuda"):
        # at full size on the CPU: what it will take, and a refusal now, not minutes of swapping later
        from ..model.memory import MemoryTooSmall, check_fits
        from ..parity.stream import cpu_need

        need, how = cpu_need(meta, batch, seq, steps, reference, layers)
        try:
            click.echo(check_fits(need, "cpu", f"verify at full size on the CPU ({how})",
                                  hint="--tiny (the default on a CPU) verifies a tiny model of the same architecture; "
                                       "--layers N keeps fewer decoder layers"), err=True)
        except MemoryTooSmall as e:
            raise UsageFailure(str(e)) from None
    del meta

    def factory():
        import torch

        torch.manual_seed(seed)
        # the first build says what verify runs on (random weights, seed); the others are the same model
        log = None if told else (lambda m: click.echo(m, err=True))
        told.append(True)
        return _load_model(model, meta=False, dtype=build_dt, device=build_dev, tiny=tiny, seed=seed,
                           log=log or (lambda m: None), layers=layers).model

    t0 = time.perf_counter()

    def say(m: str) -> None:
        click.echo(f"[verify {time.perf_counter() - t0:7.1f}s] {m}", err=True)

    try:
        report = run_verify(sp, factory, dtype=dtype, batch=batch, seq=seq, steps=steps, seed=seed, device=device,
                            layers=layers, reference=reference, images=images, log=say if progress else None)
    except VerifyError as e:           # out of memory, or a reference that cannot run as asked
        raise UsageFailure(str(e)) from None
    if progress:
        say("done")
    if as_json:
        doc = {"ok": report.passed, "exit_code": report.exit_code(), **report.to_json()}
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        console = _console()
        if console.is_terminal:
            report.render_table(console)
        else:                 # a file, a pipe, grep: a whole line per check, never wrapped
            for line in report.plain_lines():
                click.echo(line)
    sys.exit(report.exit_code())


def _verify_parallel(spec: str, model: str, nproc: int, layout: str, steps: int, as_json: bool) -> None:
    """verify --tp: the family's tiny model on ``nproc`` gloo processes (patchdsl.parity.tensor_parallel)."""
    from ..parity.tensor_parallel import Case, report_lines, spawn

    _read_spec(spec)                                          # a bad spec: exit 2 before any process starts
    family = _load_model(model, meta=True, tiny=True, log=lambda m: None).model.config.model_type
    if layout == "fsdp_tp" and nproc % 2:
        raise UsageFailure(f"--tp-layout fsdp_tp needs an even number of processes, got --tp {nproc}")
    try:
        res = spawn(Case(family, spec, layout, steps=steps), nproc)
    except RuntimeError as e:
        raise UsageFailure(str(e)) from None
    if as_json:
        click.echo(json.dumps({"ok": res["passed"], "exit_code": 0 if res["passed"] else 1, **res}, indent=2,
                              default=str))
    else:
        for line in report_lines(res):
            click.echo(line)
    sys.exit(0 if res["passed"] else 1)
