"""Every command and option of the CLI explains itself; bench lists its subcommands."""

import click
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
    (["bench", "ops", "--help"], ["usage: patchdsl bench ops", "--impls", "--json"]),
    (["bench", "e2e", "--help"], ["usage: patchdsl bench e2e", "--variants"]),
])
def test_bench_help(args, must, capsys):
    with pytest.raises(SystemExit) as ei:
        main.main(args, standalone_mode=False, prog_name="patchdsl")
    assert ei.value.code == 0
    text = capsys.readouterr().out
    for m in must:
        assert m in text, (m, text[:2000])


def test_bench_results_default_to_the_current_directory(tmp_path, monkeypatch):
    from patchdsl.bench import cli as bench_cli

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    assert bench_cli._out_dir() == tmp_path
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    assert bench_cli._out_dir() == tmp_path / "o"
