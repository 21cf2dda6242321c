"""The training corpus: text every Python installation carries, extracted deterministically.

    docs = corpus.extract()                      # [Doc(kind, id, text, split)], sorted, same bytes each run
    corpus.write(docs, ".carry/corpus")          # <kind>.<split>.jsonl, then manifest.json
    docs = corpus.read(".carry/corpus")
    python -m kdlib.corpus --out .carry/corpus

Three kinds of text (KINDS), so that acceptance can be measured per kind:

* code: the standard library's own `.py` sources (its test suite included: more code for a model
  this size to learn from), one document per file. Left out: `site-packages`, the `encodings`
  charmap tables, `pydoc_data` (prose, below) and files over MAX_FILE_BYTES (generated tables,
  test data). Files are read as UTF-8; a file that is not is skipped.
* prose: the English documentation topics of `pydoc_data.topics` (what `help('topic')` prints),
  one document per topic. The training split is topped up with long docstrings (>= MIN_DOCSTRING
  characters) of the training-split code modules, as more English prose; held-out prose is only
  held-out topics, so no held-out text is seen in training.
* templated: repetitive, structured listings generated from stdlib data: `calendar` year pages
  (1800..2199), Unicode character-name tables (`unicodedata`, 64 code points a page),
  HTML entity tables (`html.entities`), HTTP status, errno and keyword listings.

Splits: a document is held out when crc32("<kind>:<id>") % 1000 falls below its kind's rate
(HELD_OUT_PER_MILLE). crc32 of a fixed string is the same everywhere, so the split of a document
never changes; which documents exist depends on the Python version (the manifest records it).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import sysconfig
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from kdlib.cli import output_folder
from kdlib.files import atomic_write_text

KINDS = ("code", "prose", "templated")
SPLITS = ("train", "held_out")
# Held-out share per kind, per mille. Prose has only ~80 topics, so it takes a larger share to
# leave enough held-out text (~10 topics) for a perplexity figure.
HELD_OUT_PER_MILLE = {"code": 40, "prose": 120, "templated": 50}
MAX_FILE_BYTES = 200_000  # the larger stdlib .py files are mostly generated tables and test data
MIN_DOCSTRING = 300  # characters: shorter docstrings are one-liners, more signature than prose
SKIP_TOP = {"site-packages", "dist-packages", "encodings", "pydoc_data", "__phello__"}
UNICODE_PAGE = 64  # code points per table page: ~3 kB of text, a few hundred tokens
UNICODE_LIMIT = 0x3000  # BMP up to CJK symbols: alphabets and symbols, before the ideograph blocks
CALENDAR_YEARS = range(1800, 2200)


@dataclass(frozen=True)
class Doc:
    kind: str
    id: str
    text: str
    split: str


def split_of(kind: str, doc_id: str) -> str:
    """'held_out' or 'train' for a document, from crc32 of its kind and id (stable everywhere)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return (
        "held_out" if zlib.crc32(f"{kind}:{doc_id}".encode()) % 1000 < HELD_OUT_PER_MILLE[kind] else "train"
    )


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_docs(root: Path) -> list[Doc]:
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in SKIP_TOP or rel.parts[0].startswith("config-"):
            continue
        if f.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            doc_id = rel.as_posix()
            out.append(Doc("code", doc_id, text, split_of("code", doc_id)))
    return out


def _docstrings(text: str) -> list[str]:
    """Long docstrings of a module and its classes and functions, dedented, in source order."""
    try:
        with warnings.catch_warnings():  # some stdlib sources hold invalid escape sequences in plain strings
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = ast.parse(text)
    except SyntaxError:
        return []
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    found = []
    for n in nodes:
        doc = ast.get_docstring(n, clean=True)
        if doc and len(doc) >= MIN_DOCSTRING:
            found.append((getattr(n, "lineno", 0), doc))
    return [d for _, d in sorted(found, key=lambda x: x[0])]


def _prose_docs(code: list[Doc]) -> list[Doc]:
    from pydoc_data.topics import topics

    out = [Doc("prose", f"topic/{k}", topics[k], split_of("prose", f"topic/{k}")) for k in sorted(topics)]
    for d in code:
        if d.split != "train":
            continue
        docs = _docstrings(d.text)
        if docs:
            out.append(Doc("prose", f"docstrings/{d.id}", "\n\n".join(docs) + "\n", "train"))
    return out


def _templated_docs() -> list[Doc]:
    import calendar
    import errno
    import html.entities
    import http
    import keyword
    import unicodedata

    pages: list[tuple[str, str]] = []
    cal = calendar.TextCalendar(firstweekday=0)
    for y in CALENDAR_YEARS:
        pages.append((f"calendar/{y}", cal.formatyear(y)))
    for start in range(0x20, UNICODE_LIMIT, UNICODE_PAGE):
        rows = []
        for cp in range(start, start + UNICODE_PAGE):
            name = unicodedata.name(chr(cp), "")
            if name:
                rows.append(f"U+{cp:04X}\t{unicodedata.category(chr(cp))}\t{name}")
        if len(rows) >= UNICODE_PAGE // 2:  # skip pages that are mostly unassigned
            pages.append((f"unicode/{start:04X}", "\n".join(rows) + "\n"))
    ents = sorted(html.entities.name2codepoint.items())
    for i in range(0, len(ents), UNICODE_PAGE):
        rows = [
            f"&{n}; = U+{cp:04X} {unicodedata.name(chr(cp), '?')}" for n, cp in ents[i : i + UNICODE_PAGE]
        ]
        pages.append((f"entities/{i // UNICODE_PAGE:02d}", "\n".join(rows) + "\n"))
    pages.append(
        ("http_status", "".join(f"{s.value} {s.phrase}: {s.description}\n" for s in http.HTTPStatus))
    )
    pages.append(("errno", "".join(f"{code:4d} {name}: {os.strerror(code)}\n"
                                   for code, name in sorted(errno.errorcode.items()))))
    pages.append(("keywords", "".join(f"keyword {i:2d}: {k}\n" for i, k in enumerate(keyword.kwlist))))
    return [Doc("templated", i, t, split_of("templated", i)) for i, t in pages]


def extract(root: Path | None = None) -> list[Doc]:
    """Every document of the corpus, sorted by (kind, id). Deterministic for a given Python."""
    code = _code_docs(Path(root) if root is not None else stdlib_dir())
    docs = code + _prose_docs(code) + _templated_docs()
    return sorted(docs, key=lambda d: (KINDS.index(d.kind), d.id))


def write(docs: list[Doc], out: str | Path) -> dict:
    """Write `<kind>.<split>.jsonl` (one {"id", "text"} per line) and manifest.json; returns the manifest.
    Each file is written whole or not at all, and an old manifest goes first: a rewrite stopped part-way
    leaves a folder that `read` calls no corpus, not a mix of two."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    manifest = {"python": sys.version.split()[0], "held_out_per_mille": HELD_OUT_PER_MILLE, "files": {}}
    for kind in KINDS:
        for split in SPLITS:
            sel = [d for d in docs if d.kind == kind and d.split == split]
            text = "".join(json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n" for d in sel)
            name = f"{kind}.{split}.jsonl"
            atomic_write_text(out / name, text)
            manifest["files"][name] = {"docs": len(sel), "chars": sum(len(d.text) for d in sel),
                                       "sha256": hashlib.sha256(text.encode()).hexdigest()}
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def read(folder: str | Path) -> list[Doc]:
    """The documents written by `write`, in file order; a file whose bytes are not those the manifest
    hashed is a ValueError naming it."""
    folder = Path(folder)
    if not (folder / "manifest.json").is_file():
        raise ValueError(f"{folder}: no corpus here (manifest.json missing); build it with python -m "
                         f"kdlib.corpus --out {folder}")
    files = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["files"]
    docs = []
    for kind in KINDS:
        for split in SPLITS:
            name = f"{kind}.{split}.jsonl"
            raw = (folder / name).read_bytes()
            if hashlib.sha256(raw).hexdigest() != files[name]["sha256"]:
                raise ValueError(f"{folder / name}: not the file manifest.json describes (another corpus's, "
                                 f"or changed since); rebuild with python -m kdlib.corpus --out {folder}")
            for line in raw.decode("utf-8").split("\n")[:-1]:  # one a line; a text may hold U+2028
                d = json.loads(line)
                docs.append(Doc(kind, d["id"], d["text"], split))
    return docs


def asdicts(docs: list[Doc]) -> list[dict]:
    return [asdict(d) for d in docs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdlib.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=output_folder, help="output folder (e.g. .carry/corpus)")
    args = ap.parse_args(argv)
    m = write(extract(), args.out)
    for name, info in m["files"].items():
        print(f"{name:28s} {info['docs']:5d} docs {info['chars'] / 1e6:7.2f} M chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
