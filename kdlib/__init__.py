"""kdlib: the shared library of the kdtree workbook.

Tree speculative decoding (DDTree over a DFlash-style block drafter) on MLA + MoE models.
One dependency direction: notebooks -> kdlib -> kernels. Heavy or optional packages (torch,
cupy, fastapi, papermill) are imported inside the functions that need them, so that
`import kdlib` works on the GPU machine, which has no papermill or FastAPI.
"""

from pathlib import Path

__version__ = "0.1.0"

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"
KERNELS = ROOT / "kernels"
NOTEBOOKS = ROOT / "notebooks"
REPORTS = ROOT / "reports"
