"""Batch runner and reports: notebooks through papermill into HTML pages and one index.

    kdlib report                                   # every notebooks/[0-9]*.ipynb, CPU defaults -> reports/
    kdlib report 00_kdtr_format -p SEED 3          # chosen notebooks, one override (value parsed as YAML)
    kdlib report --profile smoke --out /tmp/r      # parameters from notebooks/params/<stem>.smoke.yaml

For every notebook the runner writes `<out>/<stem>.ipynb` (the executed notebook; the partial one
when it failed) and `<out>/<stem>.html`, then `<out>/index.html` and `<out>/index.json`. The index
opens with the seed audit's verdict count, then lists each notebook's title and abstract (its first
`# NN · Title` markdown cell), the parameters it ran with (the defaults of its `parameters` cell,
then the profile file, then `-p` overrides), its status and duration, the error when it failed, any
stderr output its page shows, and its recorded headline values with their provenance
(`kdlib.nb.record`, read back with `kdlib.nb.read_records`; a provenance naming a report page is a
link). The audit's table, one row per seed figure with the claim in words, comes last, folded. A
failing notebook does not stop the batch; the exit code is 1 when any notebook failed. Pages of an
earlier run into the same folder stay listed, marked and counted apart from this run's; a Ctrl-C
ends the batch with status 130 and an index that names the notebooks it did not finish. The header
names the commit, and says so when uncommitted changes ran with it. The pages load nothing from the
network (nbconvert's CDN scripts are left out).

Parameters: profile `cpu` uses `notebooks/params/<stem>.cpu.yaml` when present, else the notebook's
own defaults (which are the CPU profile by convention). Any other profile requires its file. Before
anything runs, every name must be one the notebook's parameters cell defines and every value must fit
what the cell declares (the comment after each literal: type, bounds, choices; `parameter_spec`).
No notebook reads another's executed copy (the seed audit reads `data/` and kdlib), so notebooks run
in any order and alone.

Every file is written atomically (a temporary file in the same folder, then `os.replace`). Notebooks
run with the working directory set to their own folder, on the kernel `python3`, which must be this
interpreter's (the Makefile installs it with `ipykernel install --sys-prefix --name python3`).
papermill, nbconvert and nbformat are imported inside the functions that need them.
"""

from __future__ import annotations

import ast
import datetime as _dt
import html
import io
import json
import math
import os
import re
import sys
import time
import tokenize
from pathlib import Path
from urllib.parse import unquote

import yaml

from kdlib import NOTEBOOKS, REPORTS, audit
from kdlib.cli import Parser, Terminated, fail, interrupted_code, sigterm_as_interrupt
from kdlib.files import atomic_write_text
from kdlib.nb import read_records
from kdlib.perf.results import git_commit, tree_modified

KERNEL = "python3"
DEFAULT_TIMEOUT_S = 1800  # per notebook; CPU defaults run in well under a minute, GPU profiles in minutes
AUDIT_PREFIX = audit.RECORD_PREFIX


# --------------------------------------------------------------------------- notebook facts


def discover(notebooks_dir: Path, names: list[str] | None = None) -> list[Path]:
    """The numbered notebooks `[0-9]*.ipynb` of `notebooks_dir`, sorted; or the chosen ones.

    A name may be a stem (`00_kdtr_format`), a file name, a path, or a unique stem prefix (`00`).
    """
    notebooks_dir = Path(notebooks_dir)
    if not notebooks_dir.is_dir():
        raise ValueError(f"notebook folder {notebooks_dir} "
                         + ("is a file" if notebooks_dir.exists() else "does not exist"))
    every = sorted(p for p in notebooks_dir.glob("[0-9]*.ipynb") if p.is_file())  # not a folder so named
    if not names:
        if not every:
            raise ValueError(f"no notebooks (files [0-9]*.ipynb) in {notebooks_dir}")
        return every
    chosen = []
    for name in names:
        as_path = Path(name)
        if as_path.suffix == ".ipynb" and as_path.is_file():
            chosen.append(as_path.resolve())
            continue
        stem = as_path.name.removesuffix(".ipynb")
        hits = [p for p in every if p.stem == stem] or [p for p in every if p.stem.startswith(stem)]
        if len(hits) != 1:
            what = "matches no notebook" if not hits else f"is ambiguous ({', '.join(p.stem for p in hits)})"
            raise ValueError(f"notebook {name!r} {what} in {notebooks_dir}")
        chosen.append(hits[0])
    once = {}  # one run a notebook, however it was named (a stem under a relative folder, a path)
    for path in chosen:
        once.setdefault(path.resolve(), path)
    stems = {}  # the pages are <out>/<stem>.*: two notebooks of one stem would write over each other
    for path in once.values():
        if path.stem in stems:
            raise ValueError(f"{stems[path.stem]} and {path} share the name {path.stem!r}: their pages would "
                             "be one; run them in two batches (two --out folders)")
        stems[path.stem] = path
    return list(once.values())


def _comments(source: str) -> dict[int, str]:
    """line number -> the comment on that line (by tokens: a '#' inside a string is no comment)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string[1:].strip() for t in tokens if t.type == tokenize.COMMENT}


class Expression(str):
    """The source text of a parameter default that is no literal (`8 * 2**20`): typed by its comment alone."""


def parse_parameters_cell(source: str) -> dict[str, dict]:
    """name -> {"value": literal (or its source text, an `Expression`, when not a literal), "help": trailing
    comment}."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"parameters cell is not valid Python: {e}") from e
    comments = _comments(source)
    params = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        else:
            continue
        try:
            literal = ast.literal_eval(value)
        except ValueError:
            literal = Expression(ast.get_source_segment(source, value))
        # the comment of a wrapped assignment may sit on any of its lines
        said = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        params[target] = {"value": literal, "help": " ".join(said)}
    return params


def notebook_info(path: Path) -> dict:
    """Title, abstract (Markdown) and parameter defaults of a notebook, read without running it."""
    import nbformat

    try:
        nb = nbformat.read(str(path), as_version=4)
    except (OSError, ValueError, KeyError, AttributeError, TypeError, nbformat.ValidationError) as e:
        raise ValueError(f"{path}: not a readable notebook ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None
    title, abstract = path.stem, ""
    first_md = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if first_md is not None:
        lines = first_md.source.strip().splitlines()
        if lines and lines[0].startswith("# "):
            title, abstract = lines[0][2:].strip(), "\n".join(lines[1:]).strip()
        else:
            abstract = first_md.source.strip()
    tagged = [c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    if len(tagged) > 1:
        raise ValueError(f"{path.name}: {len(tagged)} cells are tagged 'parameters'; papermill needs exactly "
                         "one")
    defaults = parse_parameters_cell(tagged[0].source) if tagged else {}
    return {"title": title, "abstract": abstract, "defaults": defaults, "has_parameters_cell": bool(tagged)}


# --------------------------------------------------------------------------- parameter types

_NUMBER = r"-?\d[\d_]*(?:\.\d+)?(?:[eE]-?\d+)?"
_TYPE_WORD = re.compile(r"^(list)?\s*(?:of\s+|\[)?\s*(int|float|str|bool)\b")
_RANGE = re.compile(rf"(?<![\w.])({_NUMBER})\s*\.\.\s*({_NUMBER})(?![\w.])")
_INTERVAL = re.compile(rf"\bin\s*([\[(])\s*({_NUMBER})\s*,\s*({_NUMBER})\s*([\])])")
_COMPARE = re.compile(rf"(>=|<=|>|<|≥|≤)\s*({_NUMBER})(?![\w.])")
_BARE_CHOICES = re.compile(r"^\s*[\w.-]+(?:\s*\|\s*[\w.-]+)+\s*$")
_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
_OPS = {
    ">=": lambda v, b: v >= b,
    ">": lambda v, b: v > b,
    "<=": lambda v, b: v <= b,
    "<": lambda v, b: v < b,
}


def _kind_of(value) -> type | None:
    """bool, int, float or str of a scalar literal; None for anything else."""
    for kind in (bool, int, float, str):  # bool first: True is an int too
        if isinstance(value, kind):
            return kind
    return None


def parameter_spec(default, comment: str) -> dict:
    """What a parameter accepts, from its literal and the comment after it.

    The comment may open with a type (`int`, `float`, `str`, `bool`, `list of int`, `list[str]`,
    `... | None`), and may state bounds anywhere (`>= 1`, `> 0`, `1..16`, `in [0, 1]`) and, for
    strings, choices (quoted, `"auto" or "never"`, or a bare `a | b | c` after the colon). The
    literal's own type is the floor: an int literal under a `float` comment accepts floats, a float
    literal always accepts ints; `None` is accepted when the literal is None or the comment says None.
    Returns {kind (type or None: anything), is_list, none_ok, bounds [(op, number)], choices (tuple or None)}.
    """
    text = comment.strip()
    m = _TYPE_WORD.match(text)
    said = _KINDS[m.group(2)] if m else None
    is_list = isinstance(default, list) or bool(m and m.group(1))
    if isinstance(default, list):
        kinds = {_kind_of(x) for x in default}
        literal = kinds.pop() if len(kinds) == 1 else (float if kinds == {int, float} else None)
    else:
        literal = _kind_of(default)
    if isinstance(default, Expression):  # an expression's value is known when the notebook runs
        literal = None
    elif not isinstance(default, (list, str, int, float, type(None))):  # a dict or tuple
        literal, said = None, None
    kind = literal or said
    if said is not None and literal is not None and said is not literal:
        kind = float if {said, literal} == {int, float} else literal
    bounds = []
    for lo, hi in _RANGE.findall(text):
        bounds += [(">=", float(lo)), ("<=", float(hi))]
    for left, lo, hi, right in _INTERVAL.findall(text):
        bounds += [(">=" if left == "[" else ">", float(lo)), ("<=" if right == "]" else "<", float(hi))]
    text_wo_intervals = _INTERVAL.sub("", text)
    bounds += [
        ({"≥": ">=", "≤": "<="}.get(op, op), float(n)) for op, n in _COMPARE.findall(text_wo_intervals)
    ]
    choices = None
    if kind is str:
        quoted = re.findall(r'"([^"]*)"', text)
        after = text.split(":", 1)[1] if ":" in text else ""
        if quoted:
            choices = tuple(dict.fromkeys(quoted))
        elif _BARE_CHOICES.match(after):
            choices = tuple(c.strip() for c in after.split("|"))
    return {
        "kind": kind,
        "is_list": is_list,
        "none_ok": default is None or bool(re.search(r"\bNone\b", text)),
        "bounds": bounds if kind in (int, float) else [],
        "choices": choices,
    }


def _kind_name(spec: dict) -> str:
    name = spec["kind"].__name__ if spec["kind"] else "value"
    name = f"list of {name}" if spec["is_list"] else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    bounds = ", ".join(f"{op} {n:g}" for op, n in spec["bounds"])
    choices = " or ".join(map(repr, spec["choices"])) if spec["choices"] else ""
    return name + "".join(f" ({x})" for x in (bounds, choices) if x) + (" or None" if spec["none_ok"] else "")


def _scalar_problem(value, spec: dict) -> str | None:
    kind = spec["kind"]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, kind)
    if not ok:
        return f"got {value!r} ({type(value).__name__})"
    if kind is float:
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int past a float's range
            return f"got an int of {len(str(abs(value)))} digits, past a float's range"
        if not finite:
            return f"got {value!r}"
    failed = [f"{op} {n:g}" for op, n in spec["bounds"] if not _OPS[op](value, n)]
    if failed:
        return f"got {value!r}, which is not {' and '.join(failed)}"
    if spec["choices"] is not None and value not in spec["choices"]:
        return f"got {value!r}"
    return None


def check_parameter(value, spec: dict) -> str | None:
    """None when `value` fits `spec` (see `parameter_spec`), else what is wrong, in words."""
    if value is None:
        return None if spec["none_ok"] else "got None"
    if not spec["is_list"]:
        return _scalar_problem(value, spec)
    if not isinstance(value, list):
        return f"got {value!r} ({type(value).__name__}), not a list"
    if not value:
        return "got an empty list"
    for x in value:
        problem = _scalar_problem(x, spec)
        if problem:
            return f"element {problem}"
    return None


_OCTAL = re.compile(r"[-+]?0[0-7]+")  # YAML 1.1's octal ints: 010 is 8


def parse_overrides(pairs: list[list[str]] | None) -> dict:
    """[['SEED', '3'], ['NAME', 'x']] -> {'SEED': 3, 'NAME': 'x'} (each value parsed as YAML)."""
    out = {}
    for name, raw in pairs or []:
        if not name.isidentifier():
            raise ValueError(f"-p {name!r}: a parameter name must be a Python identifier")
        if _OCTAL.fullmatch(raw.strip()):
            raise ValueError(f"-p {name} {raw!r}: a number with a leading zero is ambiguous (YAML reads "
                             f"{raw.strip()} as octal {yaml.safe_load(raw)}); write it without the zero")
        try:
            out[name] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"-p {name} {raw!r}: not a YAML value ({' '.join(str(e).split())})") from e
    return out


def profile_parameters(stem: str, profile: str, params_dir: Path) -> tuple[dict, Path | None]:
    """The parameters of `profile` for notebook `stem`, and the file they came from (None: defaults)."""
    path = Path(params_dir) / f"{stem}.{profile}.yaml"
    if not path.is_file():
        if profile == "cpu":
            return {}, None
        raise ValueError(f"profile {profile!r} needs {path}, which does not exist "
                         "(only profile 'cpu' falls back to the notebook's defaults)")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from e
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping NAME: value, got {type(doc).__name__}")
    return doc, path


def _typed(value, spec: dict):
    """The string 'None' means None where None is accepted (a user types -p MODELS None); a number YAML
    reads as a string (`1e-1`, `1e3`: YAML 1.1 wants `1.0e-1`) is a number where numbers are taken."""
    if value == "None" and spec["none_ok"]:
        return None
    if spec["kind"] in (int, float):
        if isinstance(value, list):
            return [_number(v, spec["kind"]) for v in value]
        return _number(value, spec["kind"])
    return value


def _number(value, kind: type):
    """`value`, or the number a string of it spells; an int where `kind` is int and the number whole
    (16.0 as 1.6e1 is)."""
    if isinstance(value, float) and kind is int and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        return value
    try:
        x = float(value)
    except ValueError:
        return value
    return int(x) if kind is int and x.is_integer() else x


def plan(paths: list[Path], profile: str, overrides: dict, params_dir: Path) -> list[dict]:
    """What each notebook will run with; every bad name, value or file is reported here, before any run."""
    jobs, problems = [], []
    for path in paths:
        try:
            info = notebook_info(path)
            from_profile, profile_file = profile_parameters(path.stem, profile, params_dir)
        except ValueError as e:
            problems.append(str(e))
            continue
        defaults = info["defaults"]
        unknown = sorted(set(from_profile) - set(defaults))
        if unknown:
            problems.append(f"{profile_file}: {unknown} are not parameters of {path.name} "
                            f"(its parameters cell defines {sorted(defaults) or 'none'})")
        params = {n: {"value": d["value"], "default": d["value"], "source": "default", "help": d["help"]}
                  for n, d in defaults.items()}
        specs = {n: parameter_spec(d["value"], d["help"]) for n, d in defaults.items()}
        for name, spec in specs.items():
            if isinstance(defaults[name]["value"], Expression):  # its value exists when the notebook runs
                continue
            problem = check_parameter(defaults[name]["value"], spec)
            if problem:
                problems.append(f"{path.name}: the default of {name} does not fit its own comment "
                                f"({defaults[name]['help']!r}: {_kind_name(spec)}): {problem}")
        injected = {}
        given = [(n, v, profile_file.name if profile_file else "", f"{profile_file}: {n}")
                 for n, v in from_profile.items()]
        given += [(n, v, "-p", f"-p {n}") for n, v in overrides.items()]
        for name, value, source, where in given:
            if name not in params:
                continue
            value = _typed(value, specs[name])
            problem = check_parameter(value, specs[name])
            if problem:
                problems.append(f"{where}: {name} of {path.stem} takes {_kind_name(specs[name])}; {problem}")
            params[name].update(value=value, source=source)
            injected[name] = value
        jobs.append(
            {
                "path": path,
                "info": info,
                "parameters": params,
                "injected": injected,
                "profile": profile,
                "profile_file": str(profile_file) if profile_file else None,
            }
        )
    defined = set().union(*(j["info"]["defaults"] for j in jobs)) if jobs else set()
    unused = sorted(set(overrides) - defined)
    if unused and len(jobs) == len(paths):
        problems.append(f"-p {', '.join(unused)}: no chosen notebook has such a parameter "
                        f"(theirs: {', '.join(sorted(defined)) or 'none'})")
    if problems:
        raise ValueError("cannot run the reports: " + "; ".join(problems))
    return jobs


# --------------------------------------------------------------------------- running


def check_kernel(kernel_name: str = KERNEL) -> str:
    """The interpreter that kernel `kernel_name` starts; it must be this one (the venv's)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel as e:
        raise ValueError(f"no Jupyter kernel named {kernel_name!r}; install this interpreter's with "
                         f"`{sys.executable} -m ipykernel install --sys-prefix --name {kernel_name}`") from e
    exe = spec.argv[0]
    # jupyter_client runs a bare 'python' / 'python3' / 'python3.11' as sys.executable.
    if exe in (
        "python",
        f"python{sys.version_info[0]}",
        f"python{sys.version_info[0]}.{sys.version_info[1]}",
    ):
        return sys.executable
    if Path(exe).absolute().parent != Path(sys.executable).absolute().parent:
        raise ValueError(f"kernel {kernel_name!r} ({spec.resource_dir}) starts {exe}, not this environment's "
                         f"{sys.executable}; reinstall it with "
                         f"`{sys.executable} -m ipykernel install --sys-prefix --name {kernel_name}`")
    return exe


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MARKED_LINE = re.compile(r"^\s*-+>\s*(\d+)\s(.*)$")  # IPython marks the raising line: '---> 15     assert x'


def _raising_line(traceback: list[str]) -> str | None:
    """The notebook line that raised: the first line IPython's traceback marks with an arrow."""
    for line in _ANSI.sub("", "\n".join(traceback)).splitlines():
        m = _MARKED_LINE.match(line)
        if m:
            return m.group(2).strip()
    return None


def _error_of(exc: BaseException) -> dict:
    """ename / evalue of a failure: the notebook's own exception when papermill reports one."""
    ename = getattr(exc, "ename", None)
    if ename is not None:  # papermill.exceptions.PapermillExecutionError
        return {"ename": ename, "evalue": str(exc.evalue), "cell_index": exc.cell_index,
                "exec_count": exc.exec_count, "line": _raising_line(exc.traceback or [])}
    return {"ename": type(exc).__name__, "evalue": str(exc).strip(), "cell_index": None, "exec_count": None,
            "line": None}


def render_html(executed: Path, html_path: Path, *, title: str) -> None:
    """HTML of an executed notebook (images embedded, inputs and outputs shown), written atomically.

    Cells tagged `remove-cell` are left out and cells tagged `remove-input` show only their outputs,
    for boilerplate that would distract a reader (nbconvert's TagRemovePreprocessor).
    """
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    nb = nbformat.read(str(executed), as_version=4)
    # the lab template less its CDN scripts (require.js, MathJax, mermaid): no page here needs them, and
    # a page must open offline without waiting on a network that drops its requests
    offline = jinja2.DictLoader({"offline.html.j2": (
        "{%- extends 'lab/index.html.j2' -%}"
        + "".join(f"{{%- block {b} -%}}{{%- endblock {b} -%}}"
                  for b in ("html_head_js_requirejs", "html_head_js_mathjax", "html_head_js_mermaidjs")))})
    exporter = HTMLExporter(embed_images=True, extra_loaders=[offline], template_file="offline.html.j2")
    exporter.register_preprocessor(
        TagRemovePreprocessor(remove_cell_tags={"remove-cell"}, remove_input_tags={"remove-input"}),
        enabled=True,
    )
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    nav = ('<nav style="font:14px system-ui,sans-serif;padding:8px 16px;border-bottom:1px solid #ddd">'
           '<a href="index.html">&larr; all notebooks</a></nav>')
    at = body.find("<body")
    if at >= 0:
        end = body.find(">", at) + 1
        body = body[:end] + nav + body[end:]
    atomic_write_text(html_path, body)


def stderr_outputs(executed: Path) -> list[dict]:
    """The stderr streams a reader would see on the page (cells tagged `remove-cell` left out):
    [{exec_count, text: its first non-empty line}]. Warnings belong fixed at their source, not shown."""
    import nbformat

    nb = nbformat.read(str(executed), as_version=4)
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code" or "remove-cell" in cell.metadata.get("tags", []):
            continue
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                line = next((ln.strip() for ln in o.get("text", "").splitlines() if ln.strip()), "")
                out.append({"exec_count": cell.get("execution_count"), "text": line[:300]})
    return out


class _DropParameterGuesses:
    """papermill guesses parameter names from the cell's text line by line and warns on lines it cannot
    read (any with two '=', such as `N = 2  # int: >= 1`), then calls the name unknown. `plan` has
    already checked every name against the parsed cell, so these two warnings only mislead."""

    MESSAGES = ("Unable to parse line", "Passed unknown parameter")

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.MESSAGES)


def run_one(job: dict, out_dir: Path, *, timeout_s: float, kernel_name: str = KERNEL,
            log_output: bool = False, progress_bar: bool = False) -> dict:
    """Execute one notebook with papermill, render its HTML; returns its index entry (never raises
    for a failure inside the notebook)."""
    import logging

    import papermill
    import zmq
    from traitlets.config import Config

    for name in ("papermill", "papermill.translators"):  # filters act only on the logger that emits
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropParameterGuesses) for f in logger.filters):
            logger.addFilter(_DropParameterGuesses())
    path: Path = job["path"]
    stem = path.stem
    executed, html_path = out_dir / f"{stem}.ipynb", out_dir / f"{stem}.html"
    partial = out_dir / f".{stem}.running.ipynb"
    # CurveZMQ keys for the kernel's sockets where pyzmq has curve (the kernelspec declares them; without,
    # ipykernel warns of plain-text TCP)
    kernel_config = Config({"KernelManager": {"transport_encryption": "auto"}} if zmq.has("curve") else {})
    deadline = time.monotonic() + timeout_s
    error = None
    t0 = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(path), str(partial), parameters=job["injected"], kernel_name=kernel_name,
            cwd=str(path.parent), progress_bar=progress_bar, log_output=log_output,
            # nbclient asks per cell: each cell may use what is left of the notebook's budget.
            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
            config=kernel_config,
        )
    except Exception as exc:  # a failing notebook is reported, not raised: the batch goes on
        error = _error_of(exc)
    except BaseException:  # Ctrl-C: leave no temporary file behind
        partial.unlink(missing_ok=True)
        raise
    duration = time.perf_counter() - t0
    if error is None and duration > timeout_s:  # each cell had at least 1 s: short cells could run past it
        error = {"ename": "Timeout", "evalue": f"the notebook ran {duration:.1f} s, past its {timeout_s:g} s",
                 "cell_index": None, "exec_count": None, "line": None}
    have_output = partial.is_file()
    html_ok = False
    try:
        if have_output:
            os.replace(partial, executed)
        elif executed.exists():
            executed.unlink()  # an older run's notebook must not pass for this run's
        if have_output:
            try:
                render_html(executed, html_path, title=job["info"]["title"])
                html_ok = True
            except Exception as exc:
                error = error or {**_error_of(exc), "ename": f"HTML export: {type(exc).__name__}"}
        if not html_ok and html_path.exists():
            html_path.unlink()
    except BaseException:  # Ctrl-C between the notebook and its page: neither may pass for the other's run
        for p in (partial, executed, html_path):
            p.unlink(missing_ok=True)
        raise
    records, stderr = [], []
    if have_output:
        try:  # a notebook that records one name twice is its own failure: the batch goes on
            records = list(read_records(executed).values())
            stderr = stderr_outputs(executed)
        except ValueError as exc:
            error = error or _error_of(exc)
    return {
        "stem": stem,
        "notebook": str(path),
        "title": job["info"]["title"],
        "abstract": job["info"]["abstract"],
        "profile": job["profile"],
        "profile_file": job["profile_file"],
        "parameters": job["parameters"],
        "status": "failed" if error else "passed",
        "error": error,
        "duration_s": round(duration, 2),
        "ran_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": job["commit"],
        "html": html_path.name if html_ok else None,
        "ipynb": executed.name if have_output else None,
        "records": records,
        "stderr": stderr,
    }


# --------------------------------------------------------------------------- index

_CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg:#ffffff; --soft:#f6f8fa;
        --ok:#1a7f37; --bad:#cf222e; --accent:#0969da; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
       font:15px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
main { max-width: 980px; margin: 0 auto; padding: 28px 20px 60px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 0; }
a { color: var(--accent); text-decoration: none; } a:hover { text-decoration: underline; }
.meta { color: var(--muted); font-size: 13px; }
.summary { margin: 14px 0 22px; font-size: 15px; }
.badge { display:inline-block; padding:1px 9px; border-radius:10px; font-size:12px; font-weight:600;
         color:#fff; vertical-align: middle; }
.passed { background: var(--ok); } .failed { background: var(--bad); }
section.nb { border:1px solid var(--line); border-radius:8px; padding:16px 18px; margin: 0 0 16px; }
section.nb.failed-card { border-left: 5px solid var(--bad); }
.head { display:flex; gap:12px; align-items:baseline; flex-wrap:wrap; }
.head .links { margin-left:auto; font-size: 13px; }
.abstract p { margin: 8px 0; }
table { border-collapse: collapse; width: 100%; margin: 8px 0; font-size: 13.5px; table-layout: fixed; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
th { background: var(--soft); font-weight: 600; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
code { font: 12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace; background: var(--soft);
       padding: 0 3px; border-radius: 3px; }
pre.error { background:#fff1f1; border:1px solid #f3c0c0; padding:10px; border-radius:6px;
            white-space: pre-wrap; font: 12.5px ui-monospace,Menlo,Consolas,monospace; margin: 8px 0; }
details > summary { cursor: pointer; color: var(--muted); font-size: 13px; margin-top: 6px; }
.changed { font-weight: 600; }
.audit { border:2px solid var(--accent); border-radius:8px; padding:12px 16px; margin: 22px 0 0; }
.audit > summary { font-size: 17px; font-weight: 600; color: var(--fg); margin: 0; }
.verdicts { margin: 0 0 18px; }
.verdict { display:inline-block; padding:1px 8px; border-radius:10px; font-size:13px; color:#1f2328; }
.warn { background:#fff8c5; border:1px solid #d4a72c; padding:6px 10px; border-radius:6px; font-size:13px; }
nav.toc ol { margin: 6px 0 20px; padding-left: 22px; }
"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _markdown(text: str) -> str:
    """Markdown -> HTML with raw HTML escaped (mistune ships with nbconvert); plain text otherwise."""
    try:
        import mistune
    except ImportError:
        return "".join(f"<p>{_esc(p)}</p>" for p in text.split("\n\n") if p.strip())
    return mistune.create_markdown(escape=True)(text)


def _fmt_number(x: float) -> str:
    """Three significant digits in plain notation (thousands separated); tiny values in e-notation."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 1e-3:
        return f"{x:.2g}"
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


BYTE_UNITS = ("B", "bytes")
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20))


def fmt_value(value, unit: str = "") -> tuple[str, str]:
    """(value, unit) as the index shows them: byte counts of a MiB and more in binary units, floats to
    three significant digits, integers with thousands separators."""
    if unit in BYTE_UNITS and isinstance(value, (int, float)) and not isinstance(value, bool):
        for name, size in _BINARY:
            if abs(value) >= size:
                return _fmt_number(value / size), name
        return f"{value:,.0f}", "B"
    if isinstance(value, bool) or value is None:
        return str(value), unit
    if isinstance(value, int):
        return f"{value:,}", unit
    if isinstance(value, float):
        return _fmt_number(value), unit
    if isinstance(value, (dict, list)):
        return json.dumps(value), unit
    return str(value), unit


def _head(*columns: tuple[str, int]) -> str:
    """A header row; fixed column shares (percent) keep long value names from squeezing the table."""
    return "<tr>" + "".join(f'<th style="width:{w}%">{_esc(name)}</th>' for name, w in columns) + "</tr>"


_PAGE = re.compile(r"([\w.-]+)\.html(?:#(\S+))?")


def source_link(source: str, pages: set[str]) -> str:
    """A recorded source that names a report page (`NN_name.html#anchor`, the anchor as the page's
    element id, `kdlib.audit.anchor`) is a link when that page is in this report; other sources are text."""
    m = _PAGE.fullmatch(source)
    if not m:
        return f"<code>{_esc(source)}</code>" if source else '<span class="meta">—</span>'
    stem, frag = m.group(1), m.group(2)
    section = unquote(frag) if frag else ""
    label = stem + (
        f" §{section.split('.')[0]}" if section[:1].isdigit() else (f" #{section}" if section else "")
    )
    if f"{stem}.html" not in pages:
        return f'{_esc(label)} <span class="meta">(page not in this report)</span>'
    title = f' title="{_esc(section.replace("-", " "))}"' if section else ""
    return f'<a href="{_esc(source)}"{title}>{_esc(label)}</a>'


def _records_table(records: list[dict], pages: set[str]) -> str:
    own = [r for r in records if not str(r.get("name", "")).startswith(AUDIT_PREFIX)]
    n_audit = len(records) - len(own)
    more = (f'<p class="meta">{n_audit} audit verdicts: in the <a href="#audit">seed audit table</a>.</p>'
            if n_audit else "")
    if not own:
        return more or '<p class="meta">No recorded values.</p>'
    rows = []
    for r in own:
        value, unit = fmt_value(r.get("value"), r.get("unit", ""))
        exact = r.get("value")
        title = (
            f' title="{_esc(f"{exact:,} B")}"' if unit != r.get("unit", "") and isinstance(exact, int) else ""
        )
        rows.append(f"<tr><td><code>{_esc(r.get('name'))}</code></td><td "
                    f"class=\"num\"{title}>{_esc(value)}</td>"
                    f"<td>{_esc(unit)}</td><td "
                    f"class=\"prov\">{source_link(str(r.get('source', '')), pages)}</td>"
                    f"<td>{_esc(r.get('note', ''))}</td></tr>")
    head = _head(("recorded value", 27), ("value", 12), ("unit", 9), ("provenance", 27), ("note", 25))
    return f"<table>{head}{''.join(rows)}</table>{more}"


def _parameters_table(params: dict) -> str:
    if not params:
        return '<p class="meta">No parameters cell.</p>'
    rows = "".join(
        f"<tr{' class=changed' if p['source'] != 'default' else ''}><td><code>{_esc(n)}</code></td>"
        f"<td><code>{_esc(repr(p['value']))}</code></td><td>{_esc(p['source'])}</td>"
        f"<td class=meta>{_esc(p.get('help', ''))}</td></tr>"
        for n, p in params.items()
    )
    head = _head(("parameter", 24), ("value", 22), ("from", 16), ("type / allowed", 38))
    return f"<table>{head}{rows}</table>"


def _audit_rows(entries: list[dict]) -> list[tuple[dict, dict]]:
    return [
        (e, r)
        for e in entries
        for r in e.get("records", [])
        if str(r.get("name", "")).startswith(AUDIT_PREFIX)
    ]


def _claims() -> dict:
    """Catalogue id -> the claim in words (`figure` of data/audit/seed_figures.yaml); {} when unreadable."""
    try:
        return {fid: f.figure for fid, f in audit.catalogue().items()}
    except ValueError:
        return {}


def verdict_counts(entries: list[dict]) -> dict:
    """verdict -> number of audit records, in `kdlib.audit.VERDICTS` order (other values after them)."""
    got = [str(r.get("value")) for _, r in _audit_rows(entries)]
    order = list(audit.VERDICTS) + sorted(set(got) - set(audit.VERDICTS))
    return {v: got.count(v) for v in order if v in got or v != audit.MISSING}


def _verdict_badge(verdict: str, n: int | None = None) -> str:
    colour = audit.COLOURS.get(verdict, "#d8dee9")
    count = f"<b>{n}</b> " if n is not None else ""
    return f'<span class="verdict" style="background:{colour}">{count}{_esc(verdict)}</span>'


def audit_counts_html(entries: list[dict]) -> str:
    """The verdict count at the top of the index (empty string when no notebook recorded verdicts)."""
    rows = _audit_rows(entries)
    if not rows:
        return ""
    badges = " ".join(_verdict_badge(v, n) for v, n in verdict_counts(entries).items())
    return (f'<p class="verdicts" id="verdicts">Seed audit, {len(rows)} figures: {badges} '
            '<a href="#audit">(table below)</a></p>')


def audit_summary_html(entries: list[dict], pages: set[str] | None = None) -> str:
    """The seed-audit table, folded, after the notebooks: every recorded `audit_verdict_*` value, the
    claim in words (from the catalogue), the workbook's figure and where the page shows it (empty
    string when there are none)."""
    rows = _audit_rows(entries)
    if not rows:
        return ""
    pages = {e["html"] for e in entries if e.get("html")} if pages is None else pages
    claims = _claims()
    body = []
    for e, r in rows:
        fid = r["name"].removeprefix(AUDIT_PREFIX)
        claim = _esc(claims[fid]) if fid in claims else f"<code>{_esc(fid)}</code>"
        body.append(f"<tr><td>{claim}</td><td>{_verdict_badge(str(r.get('value')))}</td>"
                    f"<td>{_esc(r.get('note', ''))}</td>"
                    f"<td class=\"prov\">{source_link(str(r.get('source', '')), pages)}</td>"
                    f"<td><a href=\"#{_esc(e['stem'])}\">{_esc(e['stem'])}</a></td></tr>")
    head = _head(("seeds' claim", 26), ("verdict", 14), ("the workbook's figure", 34), ("shown in", 14),
                 ("recorded by", 12))
    return (f'<details class="audit" id="audit"><summary>Seed audit: all {len(rows)} figures, one row each'
            f"</summary><table>{head}{''.join(body)}</table></details>")


def _stderr_note(e: dict) -> str:
    cells = e.get("stderr") or []
    if not cells:
        return ""
    where = "; ".join(f"In [{c['exec_count']}]: {c['text']}" for c in cells[:3])
    return (f'<p class="warn">stderr output on the page ({len(cells)} cell{"s" * (len(cells) > 1)}): '
            f'{_esc(where)}</p>')


def _entry_html(e: dict, pages: set[str]) -> str:
    status = e["status"]
    links = []
    if e.get("html"):
        links.append(f'<a href="{_esc(e["html"])}">{"partial " if status == "failed" else ""}HTML</a>')
    if e.get("ipynb"):
        links.append(f'<a href="{_esc(e["ipynb"])}">executed .ipynb</a>')
    title = (f'<a href="{_esc(e["html"])}">{_esc(e["title"])}</a>' if e.get("html") else _esc(e["title"]))
    err = ""
    if e.get("error"):
        where = f" (cell In [{e['error']['exec_count']}])" if e["error"].get("exec_count") is not None else ""
        line = f'\n  at: {e["error"]["line"]}' if e["error"].get("line") else ""
        err = (f'<pre class="error">{_esc(e["error"]["ename"])}{_esc(where)}: {_esc(e["error"]["evalue"])}'
               f"{_esc(line)}</pre>")
    n_changed = sum(p["source"] != "default" for p in e["parameters"].values())
    carried = " · from an earlier run" if e.get("carried_over") else ""
    profile_file = f"; file {_esc(Path(e['profile_file']).name)}" if e.get("profile_file") else ""
    return (
        f'<section class="nb{" failed-card" if status == "failed" else ""}" id="{_esc(e["stem"])}">'
        f'<div class="head"><h2>{title}</h2><span class="badge {status}">{status}</span>'
        f'<span class="meta">{e["duration_s"]:.1f} s · profile {_esc(e.get("profile", "?"))} · '
        f'{_esc(e["ran_at"])} · <code>{_esc(str(e.get("commit", "?"))[:10])}</code>{carried}</span>'
        f'<span class="links">{" · ".join(links)}</span></div>'
        f"{err}{_stderr_note(e)}"
        f'<div class="abstract">{_markdown(e["abstract"])}</div>'
        f"{_records_table(e['records'], pages)}"
        f"<details{' open' if n_changed else ''}><summary>parameters ({len(e['parameters'])}, "
        f"{n_changed} changed from the "
        f"defaults{profile_file})</summary>{_parameters_table(e['parameters'])}</details>"
        "</section>"
    )


def _renders(e: dict) -> bool:
    """Whether an entry of an earlier index.json renders (one edited by hand, or of an older layout, may
    lack keys): an entry that does not is dropped, not carried into every later index."""
    try:
        _entry_html(e, set())
    except (KeyError, TypeError, AttributeError, ValueError):
        return False
    return (e.get("status") in ("passed", "failed") and isinstance(e.get("title"), str)
            and isinstance(e.get("stem"), str))


def index_html(doc: dict) -> str:
    """The self-contained index page (inline CSS, no scripts, no external assets): the audit's verdict
    count, the notebooks (each with its abstract, recorded values and parameters), then the audit table."""
    entries = doc["notebooks"]
    pages = {e["html"] for e in entries if e.get("html")}
    n_pass, n_fail = doc["summary"]["passed"], doc["summary"]["failed"]
    summary = (f'<span class="badge passed">{n_pass} passed</span> '
               + (f'<span class="badge failed">{n_fail} failed</span>' if n_fail else "")
               + (f' · {doc["carried_over"]} more from an earlier run' if doc.get("carried_over") else "")
               + (' · <span class="badge failed">interrupted</span> before '
                  f'{", ".join(map(_esc, doc["interrupted"]))} finished' if doc.get("interrupted") else ""))
    dirty = " with uncommitted changes" if doc.get("tree_modified") else ""
    toc = "".join(
        f'<li><a href="#{_esc(e["stem"])}">{_esc(e["title"])}</a> '
        f'<span class="badge {e["status"]}">{e["status"]}</span></li>' for e in entries
    )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>kdtree workbook: reports</title><style>{_CSS}</style></head><body><main>"
        "<h1>kdtree workbook: reports</h1>"
        f'<p class="meta">Generated {_esc(doc["generated"])} · commit '
        f'<code>{_esc(doc["commit"][:12])}</code>{dirty} · '
        f'profile <code>{_esc(doc["profile"])}</code> · {_esc(doc["python"])}</p>'
        f'<p class="summary">{summary}</p>'
        f"{audit_counts_html(entries)}"
        f'<nav class="toc"><ol>{toc}</ol></nav>'
        + "".join(_entry_html(e, pages) for e in entries)
        + audit_summary_html(entries, pages)
        + "</main></body></html>\n"
    )


def write_index(out_dir: Path, entries: list[dict], *, profile: str,
                interrupted: tuple[str, ...] = ()) -> dict:
    """Write index.json and index.html (atomically); entries of notebooks not run this time are kept
    from the previous index.json when their pages are still there (counted apart from this run's).
    interrupted: the notebooks of this run that a Ctrl-C stopped or kept from running."""
    previous = []
    try:
        previous = json.loads((out_dir / "index.json").read_text()).get("notebooks", [])
    except (OSError, ValueError, AttributeError):
        pass
    ran = {e["stem"] for e in entries}
    kept = [
        {**e, "carried_over": True}
        for e in previous
        if isinstance(e, dict)
        and e.get("stem") not in ran
        and e.get("html")
        and (out_dir / e["html"]).is_file()
        and Path(e.get("notebook", "")).is_file()
        and _renders(e)
    ]
    notebooks = sorted(entries + kept, key=lambda e: e["stem"])
    doc = {
        "generated": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "tree_modified": tree_modified(),  # uncommitted changes ran too: the commit alone does not name them
        "profile": profile,
        "python": f"Python {sys.version.split()[0]}",
        # this run's notebooks; those kept from an earlier run are counted apart
        "summary": {status: sum(e["status"] == status for e in entries) for status in ("passed", "failed")},
        "carried_over": len(kept),
        **({"interrupted": list(interrupted)} if interrupted else {}),
        "notebooks": notebooks,
    }
    atomic_write_text(out_dir / "index.json", json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write_text(out_dir / "index.html", index_html(doc))
    return doc


# --------------------------------------------------------------------------- entry point


def run_reports(
    names: list[str] | None = None,
    *,
    profile: str = "cpu",
    overrides: dict | None = None,
    out_dir: Path = REPORTS,
    notebooks_dir: Path = NOTEBOOKS,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kernel_name: str = KERNEL,
    log_output: bool = False,
) -> list[dict]:
    """Run the notebooks, write their pages and the index; returns the entries of this run.

    Raises ValueError (before running anything) for unknown notebooks, missing or bad parameter
    files, unknown parameter names, or a kernel that is not this interpreter's.
    """
    notebooks_dir = Path(notebooks_dir)
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} exists and is not a folder")
    paths = discover(notebooks_dir, names)
    mixed = sorted({str(p.parent) for p in paths if p.parent.resolve() == out_dir.resolve()})
    if mixed:  # the executed copy <out>/<stem>.ipynb would replace the notebook itself
        raise ValueError(f"--out {out_dir} is the notebooks' own folder ({mixed[0]}): their executed copies "
                         "would overwrite them; choose another folder")
    jobs = plan(paths, profile, overrides or {}, notebooks_dir / "params")
    check_kernel(kernel_name)
    commit = git_commit()
    for job in jobs:
        job["commit"] = commit
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot create it ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out_dir}: this user cannot write there")
    entries = []
    width = max(len(p.stem) for p in paths)
    for i, job in enumerate(jobs, 1):
        print(f"[{i}/{len(jobs)}] {job['path'].stem:<{width}} running ...", flush=True)
        try:
            entry = run_one(job, out_dir, timeout_s=timeout_s, kernel_name=kernel_name, log_output=log_output,
                            progress_bar=sys.stderr.isatty())
        except KeyboardInterrupt:  # the index says which notebooks this run did not finish
            left = tuple(j["path"].stem for j in jobs[i - 1:])
            write_index(out_dir, entries, profile=profile, interrupted=left)
            raise
        entries.append(entry)
        # after each notebook: an interrupted batch still has one
        write_index(out_dir, entries, profile=profile)
        err = entry["error"]
        note = (
            ""
            if not err
            else f"  {err['ename']}: {' '.join(err['evalue'].split())[:200]}"  # one line, however long
            + (f"  at: {err['line']}" if err["line"] else "")
        )
        print(f"[{i}/{len(jobs)}] {entry['stem']:<{width}} {entry['status']} in {entry['duration_s']:.1f} "
              f"s{note}",
              flush=True)
    return entries


def cli(argv: list[str]) -> int:
    ap = Parser(prog="kdlib report", description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="stems, file names or unique prefixes (default: all)")
    ap.add_argument("--profile", default="cpu",
                    help="parameters from notebooks/params/<stem>.<profile>.yaml (default cpu: the defaults)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                    help="override a parameter (VALUE parsed as YAML); repeatable")
    ap.add_argument("--out", default=str(REPORTS), help="output folder (default reports/)")
    ap.add_argument("--notebooks-dir", default=str(NOTEBOOKS), help="where the notebooks are (default "
                                                                    "notebooks/)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds each notebook may run in all (default {DEFAULT_TIMEOUT_S})")
    ap.add_argument("--log-output", action="store_true", help="stream the notebooks' output to the terminal")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        with sigterm_as_interrupt():  # SIGTERM as Ctrl-C: the notebook in flight dropped, the index kept
            entries = run_reports(
                args.notebooks, profile=args.profile, overrides=parse_overrides(args.parameter),
                out_dir=Path(args.out), notebooks_dir=Path(args.notebooks_dir), timeout_s=args.timeout,
                log_output=args.log_output,
            )
    except ValueError as e:
        return fail("kdlib report", e)
    except KeyboardInterrupt as e:
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"kdlib report: {how}; {Path(args.out) / 'index.html'} names the notebooks that did not "
              "finish", file=sys.stderr)
        return interrupted_code(e)
    failed = [e["stem"] for e in entries if e["status"] == "failed"]
    index = Path(args.out) / "index.html"
    print(f"{len(entries) - len(failed)} passed, {len(failed)} failed in {time.perf_counter() - t0:.1f} s"
          f"{' (failed: ' + ', '.join(failed) + ')' if failed else ''} -> {index}", flush=True)
    return 1 if failed else 0
