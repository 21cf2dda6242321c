"""One plotting style for every notebook and report."""

from __future__ import annotations

PALETTE = {
    "reference": "#4c566a",
    "kernel": "#d08770",
    "baseline": "#5e81ac",
    "floor": "#a3be8c",
    "accent": "#b48ead",
    "warn": "#bf616a",
}


def style() -> None:
    """Apply the workbook's matplotlib style (inline-friendly sizes, light grid, no top/right spines)."""
    import matplotlib as mpl

    mpl.rcParams.update(
        {
            "figure.figsize": (7.0, 3.8),
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "legend.frameon": False,
            "font.size": 10,
            "axes.prop_cycle": mpl.cycler(color=list(PALETTE.values())),
        }
    )


def subplots(*args, **kwargs):
    """plt.subplots with the workbook style applied and a tight layout."""
    import matplotlib.pyplot as plt

    style()
    kwargs.setdefault("layout", "constrained")
    return plt.subplots(*args, **kwargs)
