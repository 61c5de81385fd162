"""`moetron.progress`: one redrawn line on a terminal, periodic lines elsewhere, only on rank 0."""

from __future__ import annotations

import io

from moetron.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_redrawn_and_left_on_the_final_count(monkeypatch):
    monkeypatch.setattr("moetron.progress.REDRAW_S", 0.0)  # redraw on every step
    screen = Terminal()
    progress = Progress("export", total=3, unit="tensors", stream=screen)
    assert list(progress.track(["a", "b", "c"])) == ["a", "b", "c"]
    text = screen.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, ended once at close
    assert [part.split(" (")[0] for part in text.split("\r\033[K")[1:]] == [
        "export: 1/3 tensors",
        "export: 2/3 tensors",
        "export: 3/3 tensors",
        "export: 3/3 tensors",  # the final redraw
    ]


def test_elsewhere_a_plain_line_per_interval_and_nothing_for_a_short_task():
    log = io.StringIO()
    for _ in Progress("eval", total=2, stream=log, log_every_s=3600).track(range(2)):
        pass
    assert log.getvalue() == ""  # shorter than the interval: no line at all
    for _ in Progress("plan --search", stream=log, log_every_s=0, unit="layouts").track(range(2)):
        pass
    assert [line.split(" (")[0] for line in log.getvalue().splitlines()] == [
        "plan --search: 1 layouts",
        "plan --search: 2 layouts",
    ]


def test_only_rank_zero_reports(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("moetron.progress.REDRAW_S", 0.0)
    screen = Terminal()
    progress = Progress("eval", total=1, stream=screen, log_every_s=0)
    progress.advance()
    progress.close()
    assert screen.getvalue() == ""
