"""The coverage census: every causal-LM and vision-language family of the installed transformers,
suggested, planned and verified on a tiny config (CPU), written as the table in ``docs/coverage.md``.
A vision-language family is built as its image-text-to-text model (``...ForConditionalGeneration``)
and run on an image batch built from its config (:mod:`patchdsl.parity.images`): its vision tower and
projector are suggested and verified with the language tower, LM head and loss.  A family for which
no image batch runs is run on text alone; its vision modules are left out with that reason.

    python -m patchdsl_tools.census                      # every family, writes docs/coverage.md
    python -m patchdsl_tools.census llama olmo2 --no-verify --out -   # some families, to stdout
    patchdsl census ...                            # the same

Per family: a tiny config (the family's default config shrunk by
:func:`patchdsl.model.shrink.tiny_config`: 2 layers, hidden 64-160, vocabulary 512), the model
built in fp32 on the CPU with random weights, :func:`patchdsl.planning.suggestion.suggest` (which plans every
rule it keeps; modules that one forward of the model does not call are left out, as verify could not
judge them), and :func:`patchdsl.verify` of the suggestion in fp32 (batch 1 x 8 tokens).  A
family that cannot be built, or whose suggestion fails, gets a row saying why; one family's
failure never stops the census.  The file is rewritten after every family, so an interrupted run
leaves the rows it reached (and says so in the header).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable

from patchdsl.util import files
from patchdsl.model.tiny import MAX_TINY_PARAMS, build, meta_params, quiet, short_error, tiny_family_config, vl_families
from patchdsl.parity.images import image_recipe_of

COLUMNS = ("norms", "attention", "mlp", "loss")
HEADER = ("family", "model class", "norms", "MLPs", "attention", "loss", "verify", "not covered")
FAMILY_TIMEOUT_S = 150
# the sample CI recomputes (tests/tools/test_census.py): cheap, and one family of each situation
CI_SAMPLE = ("llama", "nemotron", "gpt_neox", "llava")


@dataclass
class Row:
    family: str
    model_class: str = ""
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    verify: str = "-"             # pass / FAIL / error: ... / - (not run)
    notes: list[str] = field(default_factory=list)

    def cells(self) -> tuple[str, ...]:
        def c(name):
            if name not in self.counts:
                return "-"
            p, n = self.counts[name]
            return f"{p}/{n}" if n else "-"

        return (self.family, self.model_class or "-", c("norms"), c("mlp"), c("attention"), c("loss"),
                self.verify, "; ".join(self.notes) or "-")

    @property
    def built(self) -> bool:
        """Built from a tiny config, and the unpatched tiny model trains (so its row measures patchdsl)."""
        return bool(self.model_class) and bool(self.counts)

    @classmethod
    def from_cells(cls, c: dict) -> "Row":
        """A row read back from coverage.md (:func:`parse_table`)."""
        counts = {}
        for col in COLUMNS:
            v = c[col]
            if v != "-":
                a, b = v.split("/")
                counts[col] = (int(a), int(b))
            elif c["cls"] != "-" and c["notes"].find("does not train") < 0:
                counts[col] = (0, 0)
        notes = [] if c["notes"] == "-" else c["notes"].split("; ")
        return cls(c["family"], "" if c["cls"] == "-" else c["cls"], counts, c["verify"], notes)

    def full(self, name: str) -> bool:
        p, n = self.counts.get(name, (0, 0))
        return n > 0 and p == n


def families(vl: bool = True) -> list[str]:
    """Every model type with a causal-LM class in the installed transformers, and (``vl``) every
    vision-language one (an image-text-to-text class), sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if vl:
        out |= set(vl_families())
    return sorted(out)


class _Timeout(Exception):
    pass


def _alarm(_sig, _frame):
    raise _Timeout()


class _Timeout(Exception):
    pass


def _alarm(_sig, _frame):
    raise _Timeout()


def census_row(model_type: str, *, verify: bool = True, timeout_s: int = FAMILY_TIMEOUT_S) -> Row:
    """One family's row (never raises for a family's failure)."""

    from patchdsl.planning.suggestion import suggest

    row = Row(model_type)
    old = signal.signal(signal.SIGALRM, _alarm) if hasattr(signal, "SIGALRM") else None
    if old is not None:
        signal.alarm(timeout_s)
    try:
        with quiet():
            try:
                cfg = tiny_family_config(model_type)
            except Exception as e:
                row.notes.append(f"no tiny config: {short_error(e)}")
                return row
            try:
                n_params = meta_params(cfg)
            except Exception as e:
                row.notes.append(f"does not build (on the meta device, where its size is checked): {short_error(e)}")
                return row
            if n_params > MAX_TINY_PARAMS:
                # a tower the shrink does not reach (a vision encoder at full size): building it would
                # take gigabytes of the machine's memory
                row.notes.append(f"the tiny config still has {n_params / 1e6:.0f}M parameters (a part the shrink "
                                 f"does not reach): not built")
                return row
            try:
                model = build(cfg)
            except Exception as e:
                row.notes.append(f"does not build: {short_error(e)}")
                return row
            row.model_class = type(model).__name__
            try:
                _trains(model)
            except Exception as e:
                row.notes.append(f"the tiny model does not train unpatched: {short_error(e)}")
                row.verify = "-"
                return row
            recipe, why = image_recipe_of(model)
            try:
                from patchdsl.planning.suggestion import modules_not_run

                inputs = recipe.batch(__import__("torch").Generator().manual_seed(0), 1, 8) if recipe else None
                s = suggest(model, dtypes=("fp32",), skip=modules_not_run(model, inputs=inputs),
                            images=True if recipe is not None else (why or None))
            except Exception as e:
                row.notes.append(f"suggest failed: {short_error(e)}")
                return row
            row.counts = s.counts()
            row.notes.extend(_notes(s))
            if not s.patched:
                row.verify = "-"
                return row
            if verify:
                from patchdsl.parity import verify as run_verify

                try:
                    rep = run_verify(s.text, lambda: build(cfg), dtype="fp32", batch=1, seq=8, device="cpu",
                                     images=recipe is not None)
                    row.verify = "pass" if rep.passed else "FAIL"
                    if not rep.passed:
                        bad = [r.path for r in rep.failures()][:3] if hasattr(rep, "failures") else []
                        if bad:
                            row.notes.append("verify failed at " + ", ".join(p or "<model>" for p in bad))
                except Exception as e:
                    row.verify = "error"
                    row.notes.append(f"verify: {short_error(e)}")
    except _Timeout:
        row.verify = "timeout"
        row.notes.append(f"stopped after {timeout_s} s")
    finally:
        if old is not None:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return row


def _trains(model) -> None:
    """One unpatched forward and backward with labels: a tiny config the family cannot run is no
    finding about patchdsl (it is reported as such)."""
    import torch

    ids = torch.randint(0, int(model.config.get_text_config().vocab_size), (1, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def _notes(s) -> list[str]:
    """One note per concern left (partly) unpatched: the first reason given for it, shortened."""
    out = []
    for con in COLUMNS:
        whys = [w for p, w in s.unpatched.items() if s.concern_of.get(p) == con]
        if not whys:
            continue
        w = " ".join(whys[0].split()).replace("|", "/")
        w = re.sub(r"\(step \d+, max diff [^)]*\)", "(probe differs)", w)
        out.append(f"{con}: {w[:160]}" + ("..." if len(w) > 160 else ""))
    return out


# ------------------------------------------------------------------ the table
def _versions() -> str:
    import torch
    import transformers

    return f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]}"


def summary(rows: list[Row]) -> list[str]:
    built = [r for r in rows if r.built]
    ok = [r for r in built if r.verify == "pass"]
    base = [r for r in ok if r.full("norms") and r.full("mlp") and r.full("loss")]
    attn = [r for r in base if r.full("attention")]

    def pct(a, b):
        return f"{a}/{b} ({100 * a / b:.0f}%)" if b else f"{a}/0"

    return [f"- families: {len(rows)}; built from a tiny config and training unpatched: {len(built)}",
            f"- suggestion verifies (fp32, CPU): {pct(len(ok), len(built))} of those built",
            f"- verify with every norm, MLP and the loss patched: {pct(len(base), len(built))}",
            f"- ... and every attention module too: {pct(len(attn), len(built))}"]


def render(rows: list[Row], *, total: int | None = None, date: str | None = None, verify: bool = True) -> str:
    date = date or _dt.date.today().isoformat()
    lines = ["# Coverage of the installed transformers' causal-LM and vision-language families", "",
             f"Generated by `python -m patchdsl_tools.census` on {date} ({_versions()}); do not edit by hand.",
             "Per family: its default config shrunk to a tiny one (2 layers, random weights, CPU, fp32), "
             "`patchdsl suggest`, the suggestion planned, and `patchdsl verify` of it (batch 1 x 8 tokens)"
             + ("" if verify else " (not run: --no-verify)") + ".",
             "Each count is modules patched / modules present (q_norm/k_norm fused into attention count as "
             "patched norms; a vision-language family runs on an image batch built from its config, so its vision "
             "tower counts; modules its forward does not call, such as the vision tower of a family no image "
             "batch runs on, count as present and unpatched: verify cannot judge them); `not covered` gives the first "
             "reason per concern, or why the family has no row.", ""]
    if total is not None and total > len(rows):
        lines += [f"**Partial run: {len(rows)} of {total} families.**", ""]
    lines += summary(rows) + [""]
    lines.append("| " + " | ".join(HEADER) + " |")
    lines.append("|" + "|".join("---" for _ in HEADER) + "|")
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "/") for c in r.cells()) + " |")
    return "\n".join(lines) + "\n"


ROW_RE = re.compile(r"^\| (?P<family>[^|]+?) \| (?P<cls>[^|]+?) \| (?P<norms>[^|]+?) \| (?P<mlp>[^|]+?) \| "
                    r"(?P<attention>[^|]+?) \| (?P<loss>[^|]+?) \| (?P<verify>[^|]+?) \| (?P<notes>[^|]*?) \|$")


def parse_table(text: str) -> dict[str, dict[str, str]]:
    """The rows of a coverage.md, by family (for the freshness test)."""
    out = {}
    for line in text.splitlines():
        m = ROW_RE.match(line)
        if m and m["family"] not in ("family", "---"):
            out[m["family"]] = m.groupdict()
    return out


def run(names: Iterable[str], *, verify: bool = True, out: str | None = "docs/coverage.md",
        log=None) -> list[Row]:
    names = list(names)
    rows: list[Row] = []
    say = log or (lambda m: None)
    for n, fam in enumerate(names, 1):
        t0 = time.perf_counter()
        r = census_row(fam, verify=verify)
        rows.append(r)
        say(f"[{n}/{len(names)}] {fam}: {' '.join(r.cells()[2:7])} ({time.perf_counter() - t0:.1f} s)")
        if out and out != "-":
            files.write_text(out, render(rows, total=len(names), verify=verify), what="census table")
    if out == "-":
        sys.stdout.write(render(rows, total=len(names), verify=verify))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="patchdsl census", description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="model types (default: every causal-LM family installed)")
    ap.add_argument("--no-verify", action="store_true", help="suggest and plan only (fast)")
    ap.add_argument("--out", default="docs/coverage.md", help="the table's file ('-': stdout)")
    ap.add_argument("--sample", action="store_true", help=f"only the CI sample ({', '.join(CI_SAMPLE)})")
    ap.add_argument("--update", action="store_true",
                    help="recompute only FAMILIES and keep the other rows of --out")
    a = ap.parse_args(argv)
    names = list(CI_SAMPLE) if a.sample else (a.families or families())
    unknown = [n for n in names if n not in families()]
    if unknown:
        print(f"error: not a causal-LM or vision-language model type of this transformers: {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    try:
        if a.out != "-":
            # checked before the families run: a FIFO, a device, a folder or an unwritable file is refused
            # now, not after minutes of work (and never opened: patchdsl.util.files writes every output)
            files.check_writable(a.out, what="--out")
        keep: dict[str, Row] = {}
        if a.update:
            if not a.families or a.out == "-" or not files.is_file(a.out):
                print("error: --update needs FAMILIES and an existing --out file", file=sys.stderr)
                return 2
            keep = {f: Row.from_cells(c) for f, c in parse_table(files.read_text(a.out, "table", what="--out")).items()}
        rows = run(names, verify=not a.no_verify, out=None if keep else a.out,
                   log=lambda m: print(m, file=sys.stderr, flush=True))
        if keep:
            keep.update({r.family: r for r in rows})
            order = [f for f in families() if f in keep]
            files.write_text(a.out, render([keep[f] for f in order], total=len(families()), verify=not a.no_verify),
                             what="census table")
    except (files.FileWriteError, files.FileReadError) as e:
        print(f"error: {e}" + (" (run from the repository root, or give --out)" if getattr(e, "reason", "") == "no-folder"
                               else ""), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
