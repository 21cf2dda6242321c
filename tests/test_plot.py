"""kdlib.plot: tick labels, outside legends and display tables (Agg backend, real figures)."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd

from kdlib import plot


def test_labels():
    assert [plot.kilo(v) for v in (1024, 8192, 131072, 200000, 65)] == ["1k", "8k", "128k", "200k", "65"]
    assert [plot.si_bytes(v) for v in (500, 1e4, 2.5e6, 3e9)] == ["500 B", "10 kB", "2.5 MB", "3 GB"]
    assert [plot.plain(v) for v in (0.01, 4, 200000, 1e7)] == ["0.01", "4", "200000", "1e+07"]


def _labels(ax, axis="x"):
    fig = ax.figure
    fig.canvas.draw()
    ticks = getattr(ax, f"get_{axis}ticks")()
    return dict(zip(ticks, [t.get_text() for t in getattr(ax, f"get_{axis}ticklabels")()], strict=True))


def test_log_ticks_keep_labels_apart():
    fig, ax = plot.subplots()
    prefixes = [1024, 8192, 32768, 131072, 200000]
    ax.plot(prefixes, [1, 2, 3, 4, 5])
    plot.log_ticks(ax, prefixes, fmt=plot.kilo)
    got = _labels(ax)
    # 128k sits 0.18 decades from 200k
    assert got[200000] == "200k" and got[131072] == "" and got[1024] == "1k"
    assert ax.get_xscale() == "log" and set(got) == set(prefixes)


def test_plain_log_labels_minor_ticks_only_on_short_spans():
    fig, (short, wide) = plot.subplots(1, 2)
    short.plot([10, 60], [1, 2])
    wide.plot([1, 1e5], [1, 2])
    for ax in (short, wide):
        plot.plain_log(ax)
    fig.canvas.draw()
    minor = {
        ax: [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()] for ax in (short, wide)
    }
    assert "20" in minor[short] and "50" in minor[short]
    assert minor[wide] == []


def test_legend_outside_clears_the_axes():
    fig, ax = plot.subplots()
    for i in range(8):
        ax.plot(np.arange(5), np.arange(5) * i, label=f"series {i}", **plot.series_style(i))
    leg = plot.legend_outside(ax)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert leg.get_window_extent(r).x0 >= ax.get_window_extent(r).x1
    styles = {(plot.series_style(i)["color"], plot.series_style(i)["marker"]) for i in range(24)}
    assert len(styles) == 24  # colour x marker tells 24 series apart


def test_table_formats_floats_only_and_leaves_the_frame():
    df = pd.DataFrame({"name": ["a", "b"], "ms": [1.23456, np.nan], "n": [3, 4]})
    html = plot.table(df, "{:.2f}", caption="times (ms)").to_html()
    assert ">1.23<" in html and ">-<" in html and ">3<" in html and "times (ms)" in html
    assert df["ms"].iloc[0] == 1.23456


def test_stacked_bars_tell_every_segment_apart():
    fig, ax = plot.subplots()
    parts = {f"part {i}": [1.0, 2.0] for i in range(8)}  # more segments than the palette's six colours
    plot.stacked_bars(ax, ["a", "b"], parts, "ms", "eight parts")
    styles = {(tuple(c.patches[0].get_facecolor()), c.patches[0].get_hatch()) for c in ax.containers}
    assert len(styles) == 8


def test_tick_labels_keep_their_values():
    """Exponent-form tick labels keep the digits they need: a tick at 2.5e6 read 2e+06 before."""
    from kdlib.plot import plain

    assert [plain(v) for v in (0.01, 4, 200000, 1e6, 2.5e6, 1.2e7, 2.5e-5)] == [
        "0.01", "4", "200000", "1e+06", "2.5e+06", "1.2e+07", "2.5e-05"]
    # below 0.001 in exponent form too (1e-4 read 0.0001); two ticks past a million never read alike
    # (1234567 and 1234568 both read 1.23457e+06); a tick's float noise does not show
    assert [plain(v) for v in (1e-4, 1234567, 1234568, 0.1 * 3, 123456.7)] == [
        "1e-04", "1.234567e+06", "1.234568e+06", "0.3", "123456.7"]
