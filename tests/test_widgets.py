"""Widgets redraw through display handles, never an Output widget (see labkit.widgets)."""

import re
from pathlib import Path

import ipywidgets
import matplotlib
import pytest

from labkit import fleet_model, interval, parallelism, widgets, zero, zeropp
from labkit.course import notebooks_dir

matplotlib.use("Agg")


class _Handle:
    def __init__(self, panel):
        self.shown = [panel]

    def update(self, panel):
        self.shown.append(panel)


@pytest.fixture()
def shown(monkeypatch):
    """Capture what the widgets display instead of sending it to a frontend."""
    import IPython.display

    handles, boxes = [], []

    def display(obj, display_id=None):
        if display_id:
            handles.append(_Handle(obj))
            return handles[-1]
        boxes.append(obj)

    monkeypatch.setattr(IPython.display, "display", display)
    return handles, boxes


def test_live_draws_once_then_redraws_each_panel_on_change(shown):
    handles, boxes = shown
    slider = ipywidgets.IntSlider(value=2, min=1, max=9)
    current = widgets.live(lambda n: (f"n={n}", f"twice {2 * n}"), {"n": slider})
    assert len(boxes) == 1 and [h.shown[0].data for h in handles] == ["n=2", "twice 4"]
    slider.value = 5
    assert [h.shown[-1].data for h in handles] == ["n=5", "twice 10"]
    assert current() == ("n=5", "twice 10")


def test_live_refuses_rows_that_miss_a_control(shown):
    with pytest.raises(ValueError, match="rows must name each control exactly once"):
        widgets.live(lambda a, b: "", {"a": ipywidgets.IntSlider(), "b": ipywidgets.IntSlider()}, rows=[["a"]])


def test_every_lab_widget_renders_its_first_view(shown):
    from labkit.collectives import LINKS

    handles, _ = shown
    zero.calculator()
    parallelism.planner_widget()
    assert "cross-node per step" in zeropp.traffic_widget()()
    assert "sync" in interval.plan_widget({"sync": 2.0, "async": 0.1})()
    links = {scope: LINKS["100 Gbps"] for scope in fleet_model.SCOPES}
    assert "s per step" in fleet_model.step_time_widget(links)()
    assert len(handles) >= 6


def test_plan_text_orders_savers_by_their_cost():
    text = interval.plan_text({"sync": 2.0, "async": 0.1}, state_gb=100, mtbf_h=3, restart_s=600)
    sync_line, async_line = text.splitlines()
    assert sync_line.split()[0] == "sync:" and async_line.split()[0] == "async:"


def test_no_lab_uses_an_output_widget_or_interact():
    """An Output widget makes nbclient write to the shell channel mid-cell (jupyter/nbclient#312)."""
    pattern = re.compile(r"\binteract(ive)?\(|widgets\.Output\(|interactive_output\(")
    sources = list(notebooks_dir().glob("*.ipynb")) + list(Path(widgets.__file__).parent.glob("*.py"))
    offenders = [p.name for p in sources if p.name != "widgets.py" and pattern.search(p.read_text())]
    assert not offenders
