"""Files written whole or not at all: the one atomic writer of kdlib (KDTR files, reports, JSON results)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TMP_NAME_BYTES = 100  # of the target's name in the temp file's: within 255-byte names with the rest


def atomic_write(path, write, *, suffix: str = ".tmp") -> None:
    """Call write(file) (a binary file) on a temp file `.<name>.<random><suffix>` beside `path`, fsync,
    rename over `path`, fsync the folder: `path` is the old file or the whole new one, never a part.
    An exception removes the temp file (a killed process may leave one, never a broken target).

    A symbolic link is written through (the file it names is replaced, the link stays). The new file
    keeps the old one's permissions, or gets 0o666 less the umask, as open() would give it."""

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            write(f)

    atomic_write_path(path, fill, suffix=suffix)


def atomic_write_path(path, write, *, suffix: str = ".tmp") -> None:
    """`atomic_write` for writers that take a path: write(tmp) fills the temp file by its name (a
    library that opens the file itself, such as safetensors' save_file); the same fsync, rename and
    clean-up follow."""
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    folder = check_folder(path)
    if path.exists():
        mode = path.stat().st_mode & 0o777
    else:
        umask = os.umask(0)  # read it: os has no getter
        os.umask(umask)
        mode = 0o666 & ~umask
    stem = path.name.encode("utf-8", "surrogateescape")[:TMP_NAME_BYTES].decode("utf-8", "ignore")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{stem}.", suffix=suffix)
    except OSError as e:
        raise _about(e, tmp=None, path=path) from e
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)  # the writer's file may be closed: sync it by name
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise _about(e, tmp=tmp, path=path) from e
        raise
    if os.name == "posix":  # the rename is durable once the folder is synced (not possible on Windows)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def check_folder(path) -> Path:
    """The folder `path` would be written in; ValueError naming `path` where that is not a folder."""
    folder = Path(path).parent  # "." for a bare name
    if not folder.is_dir():
        raise ValueError(f"{path}: its folder {folder} " + ("is not a folder" if folder.exists() else
                                                             "does not exist"))
    return folder


def _about(e: OSError, *, tmp: str | None, path: Path) -> OSError:
    """`e` of the temp file `tmp` (None: while making it) told of `path`, the file the caller named."""
    if e.errno is None or (tmp is not None and e.filename not in (None, tmp)):
        return e  # no errno to restate, or about another file (the writer's own): keep it
    return type(e)(e.errno, e.strerror, str(path))


def atomic_write_text(path, text: str, *, suffix: str = ".tmp") -> None:
    """`atomic_write` of `text` in UTF-8."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), suffix=suffix)
