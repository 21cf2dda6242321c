"""One plotting style for every notebook and report.

Conventions: legends sit outside the axes (`legend_outside`), so they never cover data; log axes carry
plain-number labels at the values plotted (`log_ticks`) or at powers of ten (`plain_log`); series beyond
the palette's six colours also change marker and line style (`series_style`); count axes get integer
ticks (`int_ticks`); tables show floats rounded to their meaning with units in the headers (`table`).
"""

from __future__ import annotations

PALETTE = {
    "reference": "#4c566a",
    "kernel": "#d08770",
    "baseline": "#5e81ac",
    "floor": "#a3be8c",
    "accent": "#b48ead",
    "warn": "#bf616a",
}
COLORS = list(PALETTE.values())
MARKERS = ("o", "s", "^", "D", "v", "P")
LINESTYLES = ("-", "--", ":", "-.")


def style() -> None:
    """Apply the workbook's matplotlib style (inline-friendly sizes, light grid, no top/right spines)."""
    import matplotlib as mpl

    mpl.rcParams.update(
        {
            "figure.figsize": (7.0, 3.8),
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "axes.grid": True,
            "axes.axisbelow": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "legend.frameon": False,
            "font.size": 10,
            "axes.prop_cycle": mpl.cycler(color=COLORS),
        }
    )


def subplots(*args, **kwargs):
    """plt.subplots with the workbook style applied and a tight layout."""
    import matplotlib.pyplot as plt

    style()
    kwargs.setdefault("layout", "constrained")
    return plt.subplots(*args, **kwargs)


HATCHES = (None, "//", "..", "xx")  # stacked segments beyond the palette


def color(i: int) -> str:
    """The i-th palette colour (wrapping round); for more than six series use `series_style`."""
    return COLORS[i % len(COLORS)]


def series_style(i: int) -> dict:
    """Line keywords for series i: colour cycles fastest, then marker and line style change together, so
    up to 6 x 4 series stay distinguishable."""
    k = i // len(COLORS)
    return {
        "color": color(i),
        "marker": MARKERS[k % len(MARKERS)],
        "linestyle": LINESTYLES[k % len(LINESTYLES)],
    }


def legend_outside(target, below: bool = False, **kwargs):
    """A legend right of the axes (or of the whole figure when given one), or under the axes' x label
    with `below` (pass ncols), clear of the data."""
    from matplotlib.figure import Figure

    if isinstance(target, Figure):
        return target.legend(loc="outside lower center" if below else "outside right upper", **kwargs)
    kwargs.setdefault("loc", "upper center" if below else "upper left")
    kwargs.setdefault("bbox_to_anchor", (0.5, -0.16) if below else (1.02, 1.0))
    kwargs.setdefault("borderaxespad", 0.0)
    return target.legend(**kwargs)


def plain(v: float, _pos=None) -> str:
    """A tick label as a plain number: 0.01, 4, 200000; from a million up and below 0.001 in exponent
    form with the digits it needs (1e+06, 2.5e+06, 1.234567e+06), never rounded to another tick's value
    (twelve significant digits at most: a tick's float noise, 0.30000000000000004, reads 0.3)."""
    v = float(v)
    if v == 0 or 1e-3 <= abs(v) < 1e6:
        return f"{v:.12g}"
    for digits in range(12):
        text = f"{v:.{digits}e}"
        if abs(float(text) - v) <= 1e-12 * abs(v):
            return text
    return f"{v:.11e}"


def kilo(v: float, _pos=None) -> str:
    """A token-count label: multiples of 1024 as 8k / 128k, of 1000 as 200k, others plain."""
    for unit in (1024, 1000):
        if v >= unit and v % unit == 0:
            return f"{int(v) // unit}k"
    return plain(v)


def log_ticks(ax, values, axis: str = "x", fmt=plain, min_gap: float = 0.2) -> None:
    """Log scale on `axis` with ticks exactly at `values`, labelled by `fmt` (plain numbers, or `kilo`
    for token counts); going down from the largest, a tick closer than `min_gap` decades to the last
    labelled one keeps its mark but not its label, so labels never overlap. No minor labels."""
    import math

    from matplotlib import ticker

    ticks = sorted({float(v) for v in values})
    labels, last = {}, math.inf
    for v in reversed(ticks):
        if math.log10(last / v) >= min_gap:
            labels[v], last = fmt(v), v
    getattr(ax, f"set_{axis}scale")("log")
    a = getattr(ax, f"{axis}axis")
    a.set_major_locator(ticker.FixedLocator(ticks))
    a.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: labels.get(float(v), "")))
    a.set_minor_formatter(ticker.NullFormatter())


def si_bytes(v: float, _pos=None) -> str:
    """A byte-count label in decimal units: 500 B, 10 kB, 1 MB, 2 GB."""
    for unit, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(v) >= unit:
            return f"{v / unit:g} {name}"
    return f"{v:g} B"


def plain_log(ax, axis: str = "x", fmt=plain) -> None:
    """Log scale on `axis` labelled by `fmt` (plain numbers, or `si_bytes`) at powers of ten, and also at
    2 and 5 times them while the axis spans less than two decades."""
    import math

    from matplotlib import ticker

    getattr(ax, f"set_{axis}scale")("log")
    a = getattr(ax, f"{axis}axis")

    def minor(v, _pos):
        lo, hi = sorted(a.get_view_interval())
        return fmt(v) if lo > 0 and math.log10(hi / lo) < 2 else ""

    a.set_major_locator(ticker.LogLocator(base=10))
    a.set_major_formatter(ticker.FuncFormatter(fmt))
    a.set_minor_locator(ticker.LogLocator(base=10, subs=(2.0, 5.0)))
    a.set_minor_formatter(ticker.FuncFormatter(minor))


def int_ticks(ax, axis: str = "both") -> None:
    """Integer tick positions only (counts, indices, node ids)."""
    from matplotlib import ticker

    for name in ("x", "y") if axis == "both" else (axis,):
        getattr(ax, f"{name}axis").set_major_locator(ticker.MaxNLocator(integer=True))


def stacked_bars(ax, labels, parts: dict, ylabel: str, title: str) -> None:
    """Bars at `labels` stacked from `parts` ({segment name: values}, bottom first), legend outside in
    stack order (top segment first)."""
    import numpy as np

    bottom = np.zeros(len(labels))
    for i, (name, vals) in enumerate(parts.items()):
        vals = np.asarray(vals, dtype=float)
        # past the six colours a hatch tells a segment from the one of the same colour
        hatch = HATCHES[(i // len(COLORS)) % len(HATCHES)]
        ax.bar(labels, vals, bottom=bottom, label=name, color=color(i), hatch=hatch, edgecolor="white")
        bottom += vals
    ax.set(ylabel=ylabel, title=title)
    handles, names = ax.get_legend_handles_labels()
    legend_outside(ax, handles=handles[::-1], labels=names[::-1])


def grouped_bars(ax, groups, series: dict, value_fmt: str | None = None) -> None:
    """Side-by-side bars: one group per entry of `groups`, one bar per `series` entry ({label: values},
    one value per group); `value_fmt` (e.g. "{:.3f}") writes each value above its bar."""
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        bars = ax.bar(
            x + (i - (len(series) - 1) / 2) * width,
            np.asarray(vals, dtype=float),
            width=width,
            label=label,
            color=color(i),
        )
        if value_fmt:
            ax.bar_label(bars, labels=[value_fmt.format(v) for v in vals], fontsize=8, padding=2)
    ax.set_xticks(x, list(groups))
    ax.grid(False, axis="x")


def table(df, formats=None, caption: str | None = None, index: bool = False):
    """A pandas Styler for display: `formats` is one format string for every float column or a {column:
    format string or callable} map (floats rounded to what they mean; units belong in the column names or
    the caption); the index is hidden unless `index`. The DataFrame itself is unchanged."""
    from pandas.api.types import is_float_dtype

    if isinstance(formats, str):
        formats = {c: formats for c in df.columns if is_float_dtype(df[c])}
    st = df.style.format(formats, na_rep="-")
    if not index:
        st = st.hide(axis="index")
    if caption:
        st = st.set_caption(caption)
    return st
