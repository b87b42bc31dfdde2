"""The ``patchdsl`` command group: exit codes, the one error path, the options every command shares."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import sys
from pathlib import Path

import click

from .._version import __version__
from ..util import files
from ..util.files import FileReadError, FileWriteError
from ..syntax.errors import SpecError
from ..util.vocab import DTYPES, TARGETS

# Exit codes, the same for every command (docs/reliability.md, "Exit codes"):
EXIT_OK = 0            # the command did what was asked
EXIT_FAILED = 1        # verify / apply: a comparison against the float64 reference failed
EXIT_BAD_INPUT = 2     # the input is unusable: spec, model, options, files, or a required site refused
EXIT_INTERNAL = 3      # an unexpected exception: a bug of patchdsl (PATCHDSL_DEBUG=1 re-raises it)
EXIT_PIPE_CLOSED = 141  # stdout closed by its reader (`| head`): 128 + SIGPIPE, as a shell reports any tool so ended


class UsageFailure(Exception):
    """Bad input that is not a spec error (unknown model, unreadable file): exit 2."""


def _console(stderr: bool = False):
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal:
        c = Console(stderr=stderr, highlight=False, width=160)
    return c


EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it: never mistaken for verify's "failed"


def _json_wanted(ctx) -> bool:
    """--json was given to the command being run (parsed, or still in its raw arguments when the
    options themselves were bad)."""
    sub = ctx.meta.get("patchdsl.json")
    if sub is not None:
        return bool(sub)
    raw = getattr(ctx, "_protected_args", None)
    if raw is None:
        raw = getattr(ctx, "protected_args", None) or []
    return "--json" in list(raw) + list(ctx.args or [])


def _json_error(ctx, message: str, code: int, kind: str) -> None:
    """With --json, the error as a JSON document on stdout (the message goes to stderr as always)."""
    if _json_wanted(ctx):
        click.echo(json.dumps({"ok": False, "exit_code": code, "error": {"kind": kind, "message": message}},
                              indent=2))


def _fail(msg: str, code: int = EXIT_BAD_INPUT) -> None:
    """Stop with ``msg`` on stderr and exit ``code`` (2: bad input); under --json also the error document."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        _json_error(ctx, msg, code, "input")
    click.echo(msg, err=True)
    sys.exit(code)


def _stdout_closed() -> None:
    """The reader of stdout went away (``patchdsl plan ... | head -1``): stop quietly, as any Unix tool
    does, with status 141 (128 + SIGPIPE).  What is still buffered for stdout goes to /dev/null, so
    that Python's flush at exit does not complain about the closed pipe either."""
    files.stdout_to_devnull()
    sys.exit(EXIT_PIPE_CLOSED)


def _pipe_closed(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE)


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except OSError as e:
        if not _pipe_closed(e):
            raise
        _stdout_closed()
    except ValueError:        # stdout already closed by the command: nothing left to write
        pass


# the exceptions of later stages that are bad input, not bugs: (module, class).  Looked up only when their
# module is loaded (an exception of a module never imported cannot be one), so that an error -- or `--help`,
# which click ends with an exception -- never imports torch just to be told apart
_INPUT_ERRORS = (("patchdsl.codegen.cache", "CacheError"), ("patchdsl.codegen.render", "CodegenError"),
                 ("patchdsl.planning.plan_file", "PlanError"), ("patchdsl.runtime.patch", "PatchError"))


def _is_input_error(e: BaseException) -> bool:
    for mod, name in _INPUT_ERRORS:
        cls = getattr(sys.modules.get(mod), name, None)
        if cls is not None and isinstance(e, cls):
            return True
    return False


class _Group(click.Group):
    """The one place every command passes through: errors become messages and exit codes, a closed stdout
    a quiet exit, ``--help`` lists the shipped specs as they are in specs/."""

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        finally:
            _flush_stdout()          # output still buffered meets a closed pipe here, not at interpreter exit

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except OSError as e:         # `patchdsl --help | head -1`: click writes the help while parsing
            if not _pipe_closed(e):
                raise
            _stdout_closed()

    def format_help_text(self, ctx, formatter):
        from ..syntax.includes import shipped_names

        text = (self.help or "").replace("{shipped_specs}", ", ".join(shipped_names()) or "none found")
        saved, self.help = self.help, text
        try:
            super().format_help_text(ctx, formatter)
        finally:
            self.help = saved

    def invoke(self, ctx):
        try:
            try:
                return self._invoke(ctx)
            finally:
                _flush_stdout()
        except OSError as e:
            if not _pipe_closed(e):
                raise
            _stdout_closed()

    def _invoke(self, ctx):
        def fail(message: str, kind: str, code: int = EXIT_BAD_INPUT) -> None:
            _json_error(ctx, message, code, kind)
            click.echo(message, err=True)
            sys.exit(code)

        try:
            return super().invoke(ctx)
        except SpecError as e:
            fail(e.render(), "spec")
        except UsageFailure as e:
            fail(f"error: {e}", "input")
        except FileNotFoundError as e:
            fail(f"error: {e}", "input")
        except FileReadError as e:           # an untrusted file that cannot be read (patchdsl.util.files)
            fail(f"error: {e}", "input")
        except FileWriteError as e:          # an output that cannot be written: FIFO, device, folder, unwritable
            fail(f"error: {e}", "input")
        except click.UsageError as e:        # a bad option: click's message, exit 2 (and the JSON document)
            _json_error(ctx, e.format_message(), EXIT_BAD_INPUT, "usage")
            raise
        except (KeyboardInterrupt, click.Abort):
            fail("interrupted", "interrupted", EXIT_INTERRUPTED)
        except Exception as e:
            if isinstance(e, (click.ClickException, click.exceptions.Exit, click.exceptions.Abort)):
                raise
            if _pipe_closed(e):              # handled by invoke: a quiet exit
                raise
            # bad data that is not a spec error: a plan file, an unusable kernel cache, a value
            # that cannot go into generated code, a model the plan does not fit
            if _is_input_error(e):
                fail(f"error: {e}", "input")
            if os.environ.get("PATCHDSL_DEBUG"):
                raise
            # anything else is a bug of patchdsl, not the user's input or a failed verification:
            # its own exit status, one line that says where (PATCHDSL_DEBUG=1: the traceback)
            import traceback

            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            msg = (str(e).splitlines() or [""])[0][:300]
            fail(f"internal error: {type(e).__name__}{where}: {msg}\n"
                 f"  this is a bug in patchdsl (not your input): please report it with the command; "
                 f"PATCHDSL_DEBUG=1 shows the traceback", "internal", EXIT_INTERNAL)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="patchdsl")
def main() -> None:
    """Declarative fused Triton kernels for Hugging Face transformers models.

    SPEC, wherever a command takes one, is a path to a .kpatch file or the name of a shipped spec
    ({shipped_specs}).  --json, wherever a command takes it, prints one
    JSON document on stdout (on an error too: {"ok": false, "exit_code": 2, "error": ...}).
    Exit status: 0 success, 1 a verification failed, 2 bad input (spec, model, options),
    3 an internal error (a bug of patchdsl), 130 interrupted (Ctrl-C), 141 stdout closed by its
    reader (`| head`).
    """


def _read_spec(path: str):
    """SPEC (a file or a shipped spec's name), its includes expanded; SpecError (exit 2) if bad.
    Folders given with ``--include-dir`` may be read by its includes."""
    from ..planning.check import check_loaded
    from ..syntax.parser import read_spec

    ctx = click.get_current_context(silent=True)
    dirs = ctx.meta.get("patchdsl.include_dirs", ()) if ctx is not None else ()
    checked = check_loaded(lambda: read_spec(path, include_dirs=dirs))
    if ctx is not None:
        ctx.meta["patchdsl.checked"] = checked       # its rules, for the plan's one-line-per-rule view
    return checked.spec


def include_dir_option(f):
    """``--include-dir DIR`` (repeatable), stored for :func:`_read_spec` (not a parameter of f)."""
    def store(ctx, _param, value):
        ctx.meta["patchdsl.include_dirs"] = tuple(value)

    return click.option("--include-dir", multiple=True, expose_value=False, callback=store,
                        type=click.Path(file_okay=False, exists=True),
                        help="A folder that `include` may read besides the spec's own folder and the "
                             "shipped specs (repeatable).")(f)


def json_option(f):
    """``--json``, the same for every command: one JSON document on stdout, an error document on
    failure (see :class:`_Group`); human-readable output then goes to stderr or is left out."""
    def store(ctx, _param, value):
        ctx.meta["patchdsl.json"] = bool(value)
        return bool(value)

    return click.option("--json", "as_json", is_flag=True, callback=store, is_eager=True,
                        help="Print one JSON document on stdout (an error document on failure).")(f)


class _DtypeChoice(click.Choice):
    """fp32, bf16 or fp16; any other name is refused with :func:`patchdsl.util.vocab.dtype_hint` (fp8: the op)."""

    def convert(self, value, param, ctx):
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            from ..util.vocab import dtype_hint

            self.fail(f"{e.message}\n  hint: {dtype_hint(value)}", param, ctx)


DTYPE_CHOICE = _DtypeChoice(list(DTYPES))
TARGET_CHOICE = click.Choice(list(TARGETS))


def _default_dtype(device: str) -> str:
    """The model dtype when --dtype is not given, the same for apply and verify: bf16 on a GPU, fp32 on the CPU."""
    return "bf16" if device.startswith("cuda") else "fp32"


def _load_model(model: str, *, meta: bool, dtype: str | None = None, device: str = "cpu", log=None, tiny=False,
                seed: int = 0, layers: int | None = None):
    from ..model import ModelLoadError, load_model

    try:
        return load_model(model, meta=meta, dtype=dtype, device=device, log=log or (lambda m: click.echo(m, err=True)),
                          tiny=tiny, seed=seed, layers=layers)
    except ModelLoadError as e:
        raise UsageFailure(str(e)) from None


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
