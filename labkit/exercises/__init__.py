"""Predict, run, check: the exercises at the end of each lab's sections.

An exercise changes one thing in an experiment the lab has just run. The learner
first *predicts* a number with the lab's own model, then the exercise runs the
experiment on the learner's machine and says how far off the prediction was and
which term of the model set the number. Code exercises ask for a small function
(a sampler, a bucketing rule, a recovery policy) and test it on real files or
real ranks; their cell holds ``answer = ...`` until the learner assigns their
function to it.

A notebook cell holds the learner's answer as ``...`` until they write one::

    prediction = ...          # your number
    exercises_lab01.cache_bytes(run, prediction)

With ``...`` left in place the exercise prints what it is waiting for and runs
nothing. With ``LABKIT_SOLUTIONS=1`` (set by the test suite, or by a teacher) a
``...`` is replaced by the reference answer in :mod:`labkit.solutions`, and the
cell then *asserts* that the reference passes and that the known wrong answer
beside it fails against the same measurement: nbval keeps every exercise honest
without the answers appearing in a notebook.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

SOLUTIONS_ENV = "LABKIT_SOLUTIONS"


@dataclass(frozen=True)
class Answer:
    """A reference answer and a plausible wrong one, with what makes it wrong."""

    right: Callable[..., Any]
    wrong: Callable[..., Any]
    wrong_because: str


@dataclass(frozen=True)
class Verdict:
    """How a prediction compares with its measurement."""

    exercise: str
    predicted: float
    measured: float
    tolerance: float
    unit: str
    why: str

    @property
    def off(self) -> float:
        """Relative error of the prediction, as a fraction of the measurement."""
        return abs(self.predicted - self.measured) / abs(self.measured) if self.measured else math.inf

    @property
    def passed(self) -> bool:
        return within(self.predicted, self.measured, self.tolerance)

    def __str__(self) -> str:
        head = (f"Exercise {self.exercise}: you predicted {_number(self.predicted)} {self.unit}, "
                f"measured {_number(self.measured)} {self.unit} ({self.off:.1%} off; the check allows "
                f"{self.tolerance:.0%}).")
        verdict = "Right." if self.passed else "Not yet: look again at the model."
        return f"{head} {verdict}\n{self.why}"


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 or float(value).is_integer() else f"{value:.3g}"


def within(predicted: float, measured: float, tolerance: float) -> bool:
    """True when ``predicted`` is within ``tolerance`` (a fraction) of ``measured``."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if not (math.isfinite(predicted) and math.isfinite(measured)):
        return False
    return abs(predicted - measured) <= tolerance * abs(measured)


def solutions_enabled() -> bool:
    return os.environ.get(SOLUTIONS_ENV, "") not in ("", "0")


def reference(exercise: str) -> Answer:
    """The reference :class:`Answer` for ``exercise`` ("1.2" -> ``labkit.solutions.lab01.EX_1_2``)."""
    lab, _, number = exercise.partition(".")
    module = importlib.import_module(f"labkit.solutions.lab{int(lab):02d}")
    return getattr(module, f"EX_{lab}_{number}")


def is_blank(answer: Any) -> bool:
    """``...``: an answer not given yet (a code exercise's cell assigns the learner's function instead)."""
    return answer is Ellipsis


def waiting(exercise: str, what: str) -> None:
    """What a learner sees for an exercise not answered yet: a message, not a traceback."""
    print(f"Exercise {exercise} is waiting for you: {what}. Replace the `...` in this cell with your "
          f"answer and run it again. (Teachers and CI: set {SOLUTIONS_ENV}=1 to fill in the reference answer.)")


def predict(exercise: str, given: Any, *, what: str, measure: Callable[[], float], context: tuple = (),
            tolerance: float, unit: str, explain: Callable[[float], str]) -> Verdict | None:
    """Check a numeric prediction against a measurement made now.

    ``measure()`` runs the changed experiment; ``explain(measured)`` says which
    term of the model set the number. The reference answer and the wrong one are
    called with ``*context``. Returns ``None``, having run nothing, while the
    answer is blank and solutions are off.
    """
    answer = reference(exercise) if is_blank(given) and solutions_enabled() else None
    if is_blank(given) and answer is None:
        waiting(exercise, what)
        return None
    predicted = float(answer.right(*context) if answer else given)
    measured = float(measure())
    verdict = Verdict(exercise, predicted, measured, tolerance, unit, explain(measured))
    print(verdict)
    if answer:
        wrong = float(answer.wrong(*context))
        assert verdict.passed, f"the reference answer to {exercise} missed the measurement: {verdict}"
        assert not within(wrong, measured, tolerance), \
            f"the check of {exercise} accepts the wrong answer {_number(wrong)} ({answer.wrong_because})"
    return verdict


def check_code(exercise: str, given: Callable, *, what: str, test: Callable[[Callable], str | None]) -> bool | None:
    """Test a learner's function on real data; ``test(fn)`` returns ``None`` if it passes, else why not.

    With solutions on, a blank function is replaced by the reference, which must
    pass, and the known wrong function must fail the same test.
    """
    answer = reference(exercise) if is_blank(given) and solutions_enabled() else None
    if is_blank(given) and answer is None:
        waiting(exercise, what)
        return None
    problem = _run_test(test, answer.right if answer else given)
    print(f"Exercise {exercise}: " + ("passed." if problem is None else f"not yet: {problem}"))
    if answer:
        assert problem is None, f"the reference answer to {exercise} failed its test: {problem}"
        assert _run_test(test, answer.wrong) is not None, \
            f"the test of {exercise} passes the wrong answer ({answer.wrong_because})"
    return problem is None


def _run_test(test: Callable[[Callable], str | None], function: Callable) -> str | None:
    """A learner's function that raises has not passed; say what it raised instead of a traceback."""
    try:
        return test(function)
    except Exception as error:  # noqa: BLE001 -- the learner's code may raise anything
        return f"it raised {type(error).__name__}: {error}"
