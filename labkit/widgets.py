"""Controls that redraw a view, without an ipywidgets ``Output`` widget.

Why not ``interact`` or ``Output``: a headless runner (nbclient, behind
``labkit run`` and ``jupyter nbconvert --execute``) mimics a frontend for an
``Output`` widget, and does so by sending a comm message on the kernel's shell
channel while it is waiting on that same channel for the cell's reply. With
pyzmq's edge-triggered sockets that reply can be missed, and the cell never
finishes (jupyter/nbclient#312; a Lab 6 run hung this way). Here each view is a
display handle (``display(..., display_id=True)``) that a control's change
updates in place: JupyterLab shows the same live view, a headless run keeps the
first view as a static picture, and the runner never has to answer anything.

The logic behind every view is a pure function the tests call; this module
only wires controls to it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

View = Any
"""What a render function returns: text, a matplotlib figure, or a tuple of them (one panel each)."""


def _panels(view: View) -> tuple[Any, ...]:
    from IPython.display import Pretty
    from matplotlib.figure import Figure

    panels = view if isinstance(view, tuple) else (view,)
    shown = []
    for panel in panels:
        if isinstance(panel, Figure):
            import matplotlib.pyplot as plt

            plt.close(panel)  # shown through the handle only, not again by the inline backend
            shown.append(panel)
        else:
            shown.append(Pretty(str(panel)))
    return tuple(shown)


def live(render: Callable[..., View], controls: Mapping[str, Any],
         rows: Sequence[Sequence[str]] | None = None) -> Callable[..., View]:
    """Show ``controls`` and ``render(**values)`` below them; redraw when a control changes.

    ``rows`` groups control names into rows (default: one row each). Returns
    ``render`` with the controls' current values bound, for a cell or a test to call.
    """
    import ipywidgets
    from IPython.display import display

    rows = rows or [[name] for name in controls]
    missing = {name for row in rows for name in row} ^ set(controls)
    if missing:
        raise ValueError(f"rows must name each control exactly once; check {sorted(missing)}")

    def current() -> View:
        return render(**{name: control.value for name, control in controls.items()})

    display(ipywidgets.VBox([ipywidgets.HBox([controls[name] for name in row]) for row in rows]))
    handles = [display(panel, display_id=True) for panel in _panels(current())]

    def redraw(_change: object = None) -> None:
        for handle, panel in zip(handles, _panels(current())):
            handle.update(panel)

    for control in controls.values():
        control.observe(redraw, names="value")
    return current
