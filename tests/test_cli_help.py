"""Every command and option of the CLI explains itself; bench lists its subcommands."""

import click
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchdsl.cli import main


def _commands():
    return [name for name in main.commands if name != "bench"]


@pytest.mark.parametrize("name", _commands())
def test_every_option_has_help(name):
    cmd = main.commands[name]
    assert cmd.help and cmd.help.strip(), f"{name} has no help text"
    missing = [p.opts[0] for p in cmd.params if isinstance(p, click.Option) and not p.help]
    assert not missing, f"patchdsl {name}: options without help text: {missing}"
    out = CliRunner().invoke(main, [name, "--help"])
    assert out.exit_code == 0 and "Usage:" in out.output


def test_top_level_help_lists_every_command():
    out = CliRunner().invoke(main, ["--help"])
    assert out.exit_code == 0
    for name in main.commands:
        assert name in out.output


@pytest.mark.parametrize("args,must", [
    (["bench", "--help"], ["ops", "e2e", "specialise", "summary", "plot"]),
    (["bench", "ops", "--help"], ["usage: patchdsl bench ops", "--impls", "--json-out"]),
    (["bench", "e2e", "--help"], ["usage: patchdsl bench e2e", "--variants"]),
])
def test_bench_help(args, must, capsys):
    with pytest.raises(SystemExit) as ei:
        main.main(args, standalone_mode=False, prog_name="patchdsl")
    assert ei.value.code == 0
    text = capsys.readouterr().out
    for m in must:
        assert m in text, (m, text[:2000])


def test_bench_results_never_land_in_the_current_folder_itself(tmp_path, monkeypatch):
    """--out wins, then $OUT; otherwise a new, named bench-results/<cmd>-<time>/ folder (printed by the command)."""
    from patchdsl_tools.bench import cli as bench_cli

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    d = bench_cli._out_dir("ops")
    assert d.parent == Path("bench-results") and d.name.startswith("ops-") and d.is_dir()
    assert bench_cli._out_dir("ops", str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert bench_cli._out_dir("e2e") == tmp_path / "o"
    assert bench_cli._out_dir("e2e", "x") == Path("x")


def test_bench_help_shows_no_internal_text_and_no_subcommand_is_exit_2(capsys):
    from patchdsl_tools.bench.cli import run

    with pytest.raises(SystemExit):
        main.main(["bench", "--help"], standalone_mode=False, prog_name="patchdsl")
    text = capsys.readouterr().out
    for internal in ("forwards its raw args", "the issue's", "required: cmd"):
        assert internal not in text, internal
    assert "Exit status" in text and "bench-results" in text
    assert run([]) == 2
    assert "say which benchmark" in capsys.readouterr().err


@pytest.mark.parametrize("device,correct,verdicts", [
    ("cpu", True, {"n/a"}),                       # interpreter times are never judged
    ("cpu", False, {"n/a", "FAIL"}),              # ... but a wrong result is
    ("cuda", True, {"PASS"}),
])
def test_bench_targets_on_the_cpu_judge_results_not_times(device, correct, verdicts):
    from patchdsl_tools.bench import report

    r = {"op": "rmsnorm", "label": "6x256", "impl": "patchdsl", "group": "tiny", "status": "ok",
         "host_fwd_us": 5000.0 if device == "cpu" else 10.0, "fwd_ms": 1.0, "correct": correct, "err_max": 0.5}
    doc = {"env": {"device": device}, "results": [r]}
    got = {v for _, _, v in report.target_rows(doc, None) if v != "n/a" or device == "cpu"}
    assert got == verdicts, report.target_rows(doc, None)


def test_bench_plot_line_says_why_there_is_no_png(monkeypatch):
    import builtins

    from patchdsl_tools.bench import cli as bench_cli

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert "matplotlib is not installed" in bench_cli._png_line(None, "x.png")
    assert bench_cli._png_line("x.png", "x.png") == "plot: x.png"
