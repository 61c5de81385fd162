import pytest

from moetron import cli
from moetron.cli import COMMANDS, PLAIN_TORCHRUN_NOTE, main, report_user_error
from moetron.errors import ConfigError


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["trian"])
    assert exit_.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_under_torchrun_only_rank_zero_prints_a_flag_mistake(monkeypatch, capsys):
    """Every worker parses the same flags: N copies of argparse's usage and error would bury the one line."""
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--num-layer", "4"])
    assert exit_.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        main(["train", "--num-layer", "4"])
    assert "unrecognized arguments: --num-layer" in capsys.readouterr().err


def test_a_startup_error_under_plain_torchrun_names_moetron_launch(monkeypatch, capsys):
    """torchrun's report of the failed workers follows rank 0's line; `moetron launch` would have stopped at it."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert report_user_error(ConfigError(["--hidden-size 33 is not divisible by --num-attention-heads 4"])) == 2
    assert capsys.readouterr().err.splitlines()[-1] == PLAIN_TORCHRUN_NOTE
    monkeypatch.setenv("MOETRON_LAUNCH", "1")  # a worker of `moetron launch`: its launcher validated already
    report_user_error(ConfigError(["--hidden-size 33 is not divisible by --num-attention-heads 4"]))
    assert PLAIN_TORCHRUN_NOTE not in capsys.readouterr().err


def test_a_startup_error_on_another_rank_waits_for_rank_0_to_say_it(monkeypatch, capsys):
    """Under torchrun rank 1 must not exit before rank 0 printed the error (torchrun would stop rank 0 first): it
    waits, and says the error itself only if it is still running, i.e. rank 0 did not fail the same way."""
    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert report_user_error(ConfigError(["--data-path d: not found"])) == 2
    assert waited == [cli.STARTUP_ERROR_WAIT_S]
    assert capsys.readouterr().err == "error: rank 1: --data-path d: not found\n"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not a torchrun worker (a test's own RANK): no wait, nothing said
    assert report_user_error(ConfigError(["x"])) == 2 and waited == [cli.STARTUP_ERROR_WAIT_S]
    assert capsys.readouterr().err == ""
