"""An output path whose name the filesystem cannot hold is a one-line problem naming the flag, not an OSError."""

from __future__ import annotations

from moetron.fileio import output_dir_problem, output_file_problem

LONG = "x" * 300  # over the 255-byte name limit of every common filesystem


def test_an_over_long_directory_name_is_a_problem_naming_the_flag(tmp_path):
    problem = output_dir_problem("--save", str(tmp_path / LONG / "run"))
    assert problem.startswith(f"--save {tmp_path / LONG / 'run'}: File name too long: ")
    assert "shorten it" in problem and output_dir_problem("--save", str(tmp_path / "run")) is None


def test_an_over_long_file_name_is_a_problem_naming_the_flag(tmp_path):
    problem = output_file_problem("--json 'e.json'", tmp_path / f"{LONG}.json")
    assert problem.startswith("--json 'e.json': File name too long: ") and "shorten it" in problem
    assert output_file_problem("--json 'e.json'", tmp_path / "e.json") is None
