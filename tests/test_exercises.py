"""The exercises' machinery: blank answers, reference answers, wrong answers rejected."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from labkit import exercises
from labkit.exercises import Answer, check_code, predict, within

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_within_is_a_relative_band():
    assert within(105, 100, 0.05) and not within(106, 100, 0.05)
    assert within(3, 3, 0.0) and not within(4, 3, 0.0)
    assert not within(float("nan"), 1, 1.0)
    with pytest.raises(ValueError, match="tolerance must be >= 0, got -1"):
        within(1, 1, -1)


@pytest.fixture()
def toy(monkeypatch):
    """Exercise "9.1": the right answer is 10, the wrong one 20."""
    answers = {"9.1": Answer(right=lambda: 10.0, wrong=lambda: 20.0, wrong_because="doubles it"),
               "9.2": Answer(right=lambda x: x + 1, wrong=lambda x: x, wrong_because="forgets the one")}
    monkeypatch.setattr(exercises, "reference", answers.__getitem__)
    return answers


def _predict(given, measured=10.0, calls=None):
    def measure():
        if calls is not None:
            calls.append(1)
        return measured
    return predict("9.1", given, what="a number", measure=measure, tolerance=0.1, unit="things",
                   explain=lambda got: "because")


def test_a_blank_prediction_says_what_it_waits_for_and_runs_nothing(toy, monkeypatch, capsys):
    monkeypatch.delenv(exercises.SOLUTIONS_ENV, raising=False)
    calls = []
    assert _predict(..., calls=calls) is None
    assert calls == [], "nothing is measured for a blank answer"
    assert "Exercise 9.1 is waiting for you: a number" in capsys.readouterr().out


def test_a_learners_prediction_is_checked_and_explained(toy, monkeypatch, capsys):
    monkeypatch.delenv(exercises.SOLUTIONS_ENV, raising=False)
    assert _predict(10.5).passed
    assert not _predict(13).passed      # a wrong prediction is a verdict, not a traceback
    out = capsys.readouterr().out
    assert "30.0% off" in out and "Not yet" in out and "because" in out


def test_with_solutions_the_reference_fills_a_blank_and_must_pass(toy, monkeypatch):
    monkeypatch.setenv(exercises.SOLUTIONS_ENV, "1")
    assert _predict(...).predicted == 10.0
    with pytest.raises(AssertionError, match="reference answer to 9.1 missed"):
        _predict(..., measured=15.0)
    with pytest.raises(AssertionError, match="accepts the wrong answer 20"):
        predict("9.1", ..., what="", measure=lambda: 15.0, tolerance=0.5, unit="", explain=lambda got: "")


def test_code_exercises_test_the_function_and_reject_the_wrong_one(toy, monkeypatch):
    def test(fn):
        return None if fn(1) == 2 else f"fn(1) gave {fn(1)}"
    monkeypatch.delenv(exercises.SOLUTIONS_ENV, raising=False)
    assert check_code("9.2", ..., what="f", test=test) is None
    assert check_code("9.2", lambda x: 2 * x, what="f", test=test)
    assert check_code("9.2", lambda x: 0, what="f", test=test) is False
    monkeypatch.setenv(exercises.SOLUTIONS_ENV, "1")
    assert check_code("9.2", ..., what="f", test=test)
    with pytest.raises(AssertionError, match="passes the wrong answer"):
        check_code("9.2", ..., what="f", test=lambda fn: None)


def _exercise_ids() -> dict[int, list[str]]:
    """Exercise ids per lab, read from the exercise modules."""
    found: dict[int, list[str]] = {}
    for info in pkgutil.iter_modules(exercises.__path__):
        source = Path(importlib.import_module(f"labkit.exercises.{info.name}").__file__).read_text()
        for ident in re.findall(r'(?:predict|check_code)\(\s*"(\d+\.\d+)"', source):
            found.setdefault(int(ident.split(".")[0]), []).append(ident)
    return found


def test_every_exercise_has_a_reference_and_a_wrong_answer_and_a_notebook_cell():
    ids = _exercise_ids()
    assert sorted(ids) == list(range(1, 9)), f"labs with exercises: {sorted(ids)}; every lab has them"
    for lab, idents in ids.items():
        notebook = next(NOTEBOOKS.glob(f"{lab:02d}_*.ipynb")).read_text()
        assert len(idents) >= 2, f"lab {lab} has {len(idents)} exercise(s); each lab has two or three"
        for ident in idents:
            answer = exercises.reference(ident)
            assert isinstance(answer, Answer) and answer.wrong_because
            assert f"Exercise {ident}" in notebook, f"exercise {ident} has no cell in lab {lab}"
