"""kdlib.corpus: deterministic extraction, held-out splits by kind with no overlap, bad input."""

import json
from functools import cache

import pytest

from kdlib import corpus
from kdlib.files import atomic_write_text


@cache
def _docs():
    return tuple(corpus.extract())


def test_extraction_is_deterministic():
    assert tuple(corpus.extract()) == _docs()


def test_every_kind_has_both_splits_and_no_overlap():
    docs = _docs()
    for kind in corpus.KINDS:
        train = [d for d in docs if d.kind == kind and d.split == "train"]
        held = [d for d in docs if d.kind == kind and d.split == "held_out"]
        assert train and held, kind
        assert not {d.id for d in train} & {d.id for d in held}, kind
        assert not {d.text for d in train} & {d.text for d in held}, kind
    ids = [(d.kind, d.id) for d in docs]
    assert len(ids) == len(set(ids))


def test_held_out_is_never_in_training_under_another_kind():
    """Held-out topic text must not reach training as prose, nor held-out code as docstring prose."""
    docs = _docs()
    held_code = {d.id for d in docs if d.kind == "code" and d.split == "held_out"}
    prose_from_code = [d for d in docs if d.kind == "prose" and d.id.startswith("docstrings/")]
    assert prose_from_code and all(d.split == "train" for d in prose_from_code)
    assert not {d.id.removeprefix("docstrings/") for d in prose_from_code} & held_code
    train_texts = "\x00".join(d.text for d in docs if d.split == "train")
    for d in docs:
        if d.kind == "prose" and d.split == "held_out":
            assert d.text not in train_texts, d.id


def test_kinds_hold_what_they_say():
    docs = _docs()
    assert all(d.id.endswith(".py") for d in docs if d.kind == "code")
    assert any(d.id == "calendar/2000" for d in docs if d.kind == "templated")
    assert all(d.text.strip() for d in docs)


def test_split_follows_the_documented_rule():
    import zlib

    for d in _docs()[::50]:
        expect = zlib.crc32(f"{d.kind}:{d.id}".encode()) % 1000 < corpus.HELD_OUT_PER_MILLE[d.kind]
        assert (d.split == "held_out") == expect or d.id.startswith("docstrings/")


@pytest.mark.parametrize("kind,doc_id,split", [
    ("code", "doc/0", "held_out"), ("code", "doc/1", "train"), ("prose", "doc/1", "held_out"),
    ("prose", "doc/0", "train"), ("templated", "doc/17", "held_out"), ("templated", "doc/16", "train")])
def test_split_of_is_the_same_everywhere(kind, doc_id, split):
    """Pinned splits: a split_of that hashed with anything salted per process or platform (Python's
    hash()) would move some of them."""
    assert corpus.split_of(kind, doc_id) == split


def test_write_read_round_trips(tmp_path):
    import hashlib

    docs = list(_docs())
    manifest = corpus.write(docs, tmp_path)
    assert corpus.read(tmp_path) == sorted(
        docs, key=lambda d: (corpus.KINDS.index(d.kind), corpus.SPLITS.index(d.split))
    )
    for name, info in manifest["files"].items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == info["sha256"]
    assert json.loads((tmp_path / "manifest.json").read_text()) == json.loads(json.dumps(manifest))
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary files left behind


def test_a_rewrite_stopped_part_way_is_no_corpus(tmp_path, monkeypatch):
    def docs(n, text):  # n documents of every kind and split
        return [corpus.Doc(k, f"{k}{s}{i}", text, s)
                for k in corpus.KINDS for s in corpus.SPLITS for i in range(n)]

    corpus.write(docs(2, "old \u2028 line"), tmp_path)  # a line separator inside a text is not a line end
    assert corpus.read(tmp_path) == docs(2, "old \u2028 line")
    written = []

    def stop_at_the_fourth(path, text):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(path)
        atomic_write_text(path, text)

    monkeypatch.setattr(corpus, "atomic_write_text", stop_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        corpus.write(docs(3, "new"), tmp_path)
    with pytest.raises(ValueError, match="no corpus here"):  # three new files beside three old ones
        corpus.read(tmp_path)
    monkeypatch.undo()
    corpus.write(docs(2, "old"), tmp_path)
    (tmp_path / "code.train.jsonl").write_text('{"id": "x", "text": "changed"}\n')
    with pytest.raises(ValueError, match="code.train.jsonl: not the file manifest.json describes"):
        corpus.read(tmp_path)


def test_bad_input():
    with pytest.raises(ValueError, match="kind"):
        corpus.split_of("poetry", "x")
    with pytest.raises(ValueError, match="manifest"):
        corpus.read("/nonexistent/corpus")


def test_cli_refuses_a_file_as_its_folder(tmp_path, capsys):
    """`python -m kdlib.corpus --out FILE`: one line and exit 2 before extracting (a FileExistsError
    traceback before)."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e:
        corpus.main(["--out", str(tmp_path / "f")])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
