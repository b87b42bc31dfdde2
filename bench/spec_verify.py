"""`patchdsl verify` of EVERY shipped spec (listed from specs/) at its family's real widths, on the GPU.

    python bench/spec_verify.py [--budget 570] [--specs all | glm4,olmo2] [--per-spec 150]
                                [--device cuda --dtype bf16 --layers 2] [--extra=--tiny]

For each spec ``specs/<name>.kpatch``: transformers' own default config of the spec's family (``FAMILY``
below names the model type where it is not the spec's name) is written to a config.json, then

    python -m patchdsl.cli verify specs/<name>.kpatch --model <that config.json> --device cuda \\
        --dtype bf16 --layers 2 --full --json --progress

runs in its own process under its own time limit (``--per-spec``, cut to what is left of ``--budget``).
``--layers 2`` keeps two decoder layers, at least one of each layer type, and builds only those
(patchdsl/model/layers.py): DeepSeek-V3's and gpt-oss-120b's default configs allocate two layers.
One line per spec (spec, model type, verdict, seconds) goes to spec_verify.txt, the whole verify JSON
to spec_verify/<name>.json, everything into $PART_OUT (or --out); the verdict line comes last:
``spec_verify: PASS|FAIL: N/M specs verify (...)``.

CPU dry run (checks the script, the configs and the command lines, seconds per small spec):

    python bench/spec_verify.py --specs llama --device cpu --dtype fp32 --extra=--tiny --out /tmp/sv
    SPEC_VERIFY=llama SPEC_VERIFY_ARGS="--device cpu --dtype fp32 --extra=--tiny" bash bench/gpu_all.sh spec_verify
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# spec -> the model type whose default config it is verified on, where that is not the spec's name
FAMILY = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def shipped() -> list[str]:
    return sorted(p.stem for p in (ROOT / "specs").glob("*.kpatch"))


def default_config(spec: str, folder: Path) -> tuple[str, Path | None, str | None]:
    """(model type, path of its default config.json or None, why not)."""
    mt = FAMILY.get(spec, spec)
    try:
        from transformers import AutoConfig

        d = AutoConfig.for_model(mt).to_dict()
    except Exception as e:            # an unknown model type in this transformers: a row saying so
        return mt, None, f"no default config: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    d.pop("torch_dtype", None)        # a deprecated alias of dtype in the dict transformers writes
    d["model_type"] = mt
    path = folder / f"{spec}.config.json"
    path.write_text(json.dumps(d, indent=1, default=str))
    return mt, path, None


def run_one(spec: str, cfg: Path, a, limit: float, out: Path) -> dict:
    cmd = [sys.executable, "-m", "patchdsl.cli", "verify", str(ROOT / "specs" / f"{spec}.kpatch"), "--model", str(cfg),
           "--device", a.device, "--dtype", a.dtype, "--layers", str(a.layers), "--batch", str(a.batch),
           "--seq", str(a.seq), "--json", "--progress", *shlex.split(a.extra)]
    if "--tiny" not in cmd:
        cmd.append("--full")
    print(f"== {spec}: {' '.join(cmd[1:])} (limit {limit:.0f}s)", flush=True)
    from patchdsl_tools.bench.runner import run_offline

    rc, so, se, wall = run_offline(cmd, limit)
    sys.stdout.write(se[-2500:])
    row = {"spec": spec, "rc": rc, "seconds": round(wall, 1)}
    js = None
    if "{" in so:
        try:
            js = json.loads(so[so.index("{"):])
        except ValueError:
            js = None
    if js is not None:
        (out / f"{spec}.json").write_text(json.dumps(js, indent=1))
        if "error" in js:             # verify's error document (exit 2: e.g. out of memory, with what to try)
            row.update(passed=False, verdict=f"ERROR (exit {js.get('exit_code')}): {js['error'].get('message')}")
        else:
            row.update(passed=bool(js.get("passed")), verdict=js.get("verdict"), layers=js.get("layers"),
                       sites=len(js.get("sites", [])), reference=(js.get("reference") or {}).get("mode"),
                       peak_bytes=(js.get("memory") or {}).get("peak_bytes"))
    else:
        tail = [ln for ln in se.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        row.update(passed=False, verdict=(f"TIMED OUT at {limit:.0f}s" if rc == 124 else f"exit {rc}: {tail[0][:300]}"))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default=os.environ.get("SPEC_VERIFY") or "all",
                    help="comma-separated spec names, or all (every specs/*.kpatch); env SPEC_VERIFY")
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole run")
    ap.add_argument("--per-spec", type=float, default=float(os.environ.get("T_SPEC", 150)),
                    help="time limit of one spec's verify, seconds (env T_SPEC)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--extra", default="", help="more verify arguments, e.g. --tiny for a CPU dry run")
    ap.add_argument("--out", default=os.environ.get("PART_OUT") or "bench/results/spec_verify")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    all_specs = shipped()
    specs = all_specs if a.specs == "all" else [s.strip() for s in a.specs.split(",") if s.strip()]
    unknown = sorted(set(specs) - set(all_specs))
    if unknown:
        print(f"spec_verify: FAIL: unknown spec(s) {', '.join(unknown)} (shipped: {', '.join(all_specs)})")
        return 2
    rows = []
    (out / "spec_verify.txt").write_text(f"spec verify ({a.dtype}, --layers {a.layers}, batch {a.batch} x seq {a.seq}, "
                                         f"{a.device}{', ' + a.extra if a.extra else ''}; transformers' default configs)\n")
    for spec in specs:
        mt, cfg, why = default_config(spec, out)
        left = a.budget - (time.perf_counter() - t_start) - 3
        limit = min(a.per_spec, left)
        if cfg is None:
            row = {"spec": spec, "passed": False, "verdict": why, "seconds": 0.0}
        elif limit < 10:
            row = {"spec": spec, "passed": None, "verdict": "SKIPPED (no time left of --budget)", "seconds": 0.0}
        else:
            row = run_one(spec, cfg, a, limit, out)
        row["model_type"] = mt
        rows.append(row)
        line = f"{spec:14s} {mt:18s} {_verdict(row):7s} {row['seconds']:7.1f}s  {str(row.get('verdict'))[:220]}"
        print(f"-- {line}", flush=True)
        with open(out / "spec_verify.txt", "a") as f:      # a line per spec as it finishes: a cut run keeps them
            f.write(line + "\n")
    (out / "spec_verify.json").write_text(json.dumps({"device": a.device, "dtype": a.dtype, "layers": a.layers,
                                                       "batch": a.batch, "seq": a.seq, "specs": rows}, indent=1))
    n_ok = sum(1 for r in rows if r.get("passed"))
    ok = n_ok == len(rows)
    print(f"spec_verify: {'PASS' if ok else 'FAIL'}: {n_ok}/{len(rows)} specs verify ({a.dtype}, --layers {a.layers}, "
          f"{a.device}, {time.perf_counter() - t_start:.0f}s)")
    return 0 if ok else 1


def _verdict(row: dict) -> str:
    return "PASS" if row.get("passed") else ("SKIP" if row.get("passed") is None else "FAIL")


if __name__ == "__main__":
    sys.exit(main())
