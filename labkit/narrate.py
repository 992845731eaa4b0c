"""The "what we saw" sentences of a lab, written by code from the run's own values.

A notebook's markdown predicts in words and orderings; what a run *showed* is
printed by :func:`saw`, built from the measured values, so the words and the
numbers come from the same run on every machine and cannot go stale. The
comparison words come from the values too (:func:`times`, :func:`share`):
a sentence that says "faster" is printed only when the run was faster.
"""

from __future__ import annotations

import math
import sys
import textwrap

HEADING = "What we saw"


def saw(*sentences: str) -> str:
    """Show this run's result as a short paragraph under "What we saw"; returns the text.

    In a notebook the paragraph renders as Markdown; elsewhere it is printed,
    wrapped to 100 columns.
    """
    if not sentences or not all(isinstance(s, str) and s.strip() for s in sentences):
        raise ValueError("saw() needs at least one non-empty sentence")
    text = " ".join(s.strip() for s in sentences)
    if _in_notebook():
        from IPython.display import Markdown, display

        display(Markdown(f"**{HEADING}:** {text}"))
    else:
        print(textwrap.fill(f"{HEADING}: {text}", width=100))
    return text


def times(value: float, baseline: float, *, more: str = "faster", less: str = "slower",
          same_within: float = 0.02) -> str:
    """``value`` against ``baseline`` in words: "2.31x faster", "1.6x slower" or "about the same".

    ``more`` is the word for ``value > baseline``; the factor is always >= 1, so
    "0.43x faster" is never printed.
    """
    if not (math.isfinite(value) and math.isfinite(baseline)) or value <= 0 or baseline <= 0:
        raise ValueError(f"value and baseline must be finite and > 0, got {value} and {baseline}")
    if not 0 <= same_within < 1:
        raise ValueError(f"same_within must be in [0, 1), got {same_within}")
    ratio = value / baseline
    if abs(ratio - 1) <= same_within:
        return "about the same"
    factor = ratio if ratio > 1 else 1 / ratio
    return f"{factor:.{_digits(factor)}f}x {more if ratio > 1 else less}"


def share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``: "37% of"."""
    if whole <= 0 or not math.isfinite(part) or not math.isfinite(whole):
        raise ValueError(f"whole must be finite and > 0 and part finite, got {part} of {whole}")
    return f"{100 * part / whole:.0f}% of"


def _digits(factor: float) -> int:
    return 2 if factor < 10 else 1 if factor < 100 else 0


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
