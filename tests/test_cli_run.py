"""`forklm run FILE --arg k=v`: runs a textual or Python program file and prints its variables."""

from __future__ import annotations

import json
import pathlib

import pytest

from forklm.cli import main

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_run_textual_program_prints_variables_as_json(capsys):
    code = main(["run", str(EXAMPLES / "programs" / "few_shot_qa.fl"), "--arg", "country=Japan",
                 "--json", "--max-total-tokens", "2048"])
    assert code == 0
    variables = json.loads(capsys.readouterr().out)
    assert list(variables) == ["answer"] and "Tokyo" in variables["answer"]


@pytest.mark.slow
def test_run_python_program_file(capsys):
    code = main(["run", str(EXAMPLES / "select_truth.py"), "--arg", "statement=Water is wet.",
                 "--max-total-tokens", "2048"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict: ") and out.split(": ", 1)[1].strip("'\n") in (
        "True", "False", "Unknown")


@pytest.mark.parametrize("argv, message", [
    (["--arg", "nope"], "must look like key=value"),
    (["--arg", "city=Rome"], "city='Rome': not an argument"),
])
def test_run_bad_arguments_name_the_problem(capsys, argv, message):
    code = main(["run", str(EXAMPLES / "programs" / "few_shot_qa.fl"), *argv,
                 "--max-total-tokens", "2048"])
    assert code != 0
    assert message in capsys.readouterr().err
