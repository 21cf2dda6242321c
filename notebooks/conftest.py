"""nbval set-up for the workbook notebooks (`pytest --nbval-lax --nbval-current-env notebooks`).

nbval already runs each notebook with its own folder as the working directory, so relative paths
in notebooks resolve as they do under papermill (`kdlib report`). Here, for every notebook
collected: outputs that are not reproducible text are left out of comparisons (HTML and JavaScript
renderings, stderr, and the `kdlib.nb.record` JSON bundle, whose text/plain twin is compared), and
the patterns of `nbval_sanitize.cfg` (dates, times, addresses, commits, durations, float noise)
are applied before any comparison.
"""

from pathlib import Path

SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")
SKIP_COMPARE = ("text/html", "application/javascript", "stderr", "application/vnd.kdlib.record+json")


def pytest_collectstart(collector):
    from nbval.plugin import IPyNbFile, get_sanitize_patterns

    if isinstance(collector, IPyNbFile):
        collector.skip_compare = tuple(collector.skip_compare) + SKIP_COMPARE
        # setup() later adds any --nbval-sanitize-with patterns to these.
        collector.sanitize_patterns.update(get_sanitize_patterns(SANITIZE.read_text(encoding="utf-8")))
