"""Running the command line in-process for the CLI tests."""
from offload import cli


def run(argv, capsys):
    """(exit code, stdout, stderr) of ``offload ARGV``."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def error_line(argv, capsys) -> str:
    """The one ``offload: error:`` line of a command that must fail with exit code 2 (no traceback)."""
    code, out, err = run(argv, capsys)
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("offload: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
