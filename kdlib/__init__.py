"""kdlib: the shared library of the kdtree workbook.

Tree speculative decoding (DDTree over a DFlash-style block drafter) on MLA + MoE models.
One dependency direction: notebooks -> kdlib -> kernels. `import kdlib` imports no heavy or optional
package; cupy, fastapi and papermill are imported inside the functions that need them (the GPU machine
has no papermill or FastAPI), and torch by the modules built on it (kdlib.engine, kdlib.serve, kdlib.tp,
kdlib.training), not by kdtr, memory, estimator, ref, report or diagnose.
"""

from pathlib import Path

__version__ = "0.1.0"

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
KERNELS = ROOT / "kernels"
NOTEBOOKS = ROOT / "notebooks"
REPORTS = ROOT / "reports"
