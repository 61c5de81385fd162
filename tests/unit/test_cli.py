import subprocess
import sys

from moetron.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_a_one_line_error():
    proc = subprocess.run([sys.executable, "-m", "moetron", "trian"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice: 'trian'" in proc.stderr
