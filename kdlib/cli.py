"""The `kdlib` console script: one sub-command per module, each parsing its own arguments.

    kdlib --version | kdlib --help
    kdlib kdtr info FILE | kdtr convert A B | kdtr verify FILE
    kdlib report [NOTEBOOK ...] [--profile P] [-p NAME VALUE]
    kdlib memory CONFIG --gpu GPU --tp N --context T
    kdlib estimate [--scenario seeds] [--gpu G] [--concurrency C ...] [--block-size B] [--accepted-length A]
    kdlib serve --port P [--max-num-seqs N]
    kdlib diagnose [--endpoint URL] [--load]

Each module exposes `cli(argv: list[str]) -> int`; it is imported only when its command runs,
so a missing optional package (FastAPI on the GPU machine, say) breaks only that command.

Conventions the commands share (argparse's): bad input is one line `kdlib CMD: error: ...` on
stderr and exit status 2 (`Parser`, the argument types below, `fail` for a library's ValueError);
`kdlib` without a command prints the commands on stderr and exits 2, `kdlib --help` on stdout
with 0. Output cut short by a reader that went away (`kdlib memory ... | head`) ends the command
quietly with status 141 = 128 + SIGPIPE, what a tool killed by SIGPIPE reports.
"""

import argparse
import contextlib
import importlib
import importlib.metadata
import math
import os
import signal
import sys
import threading
from pathlib import Path

COMMANDS = {
    "kdtr": ("kdlib.kdtr", "inspect and convert KDTR tensor files"),
    "report": ("kdlib.report", "run notebooks through papermill into reports/ (HTML + index)"),
    "memory": ("kdlib.memory", "KV-cache and weight memory plan from a config.json"),
    "estimate": ("kdlib.estimator", "step-time and throughput estimator"),
    "serve": ("kdlib.serve", "OpenAI-compatible HTTP server around the batched engine (continuous batching)"),
    "diagnose": ("kdlib.diagnose", "throughput diagnosis and load test of an OpenAI-compatible endpoint"),
}
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `PROG: error: MESSAGE (see PROG --help)`, and exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def fail(prog: str, err: Exception | str) -> int:
    """Report a library's refusal (a ValueError) as `PROG: error: ...` on stderr; returns exit status 2."""
    print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
    return EXIT_USAGE


def _number(text: str, kind, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(text, float, "a positive number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _number(text, float, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    value = _number(text, float, "a fraction in (0, 1)")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1), got {text!r}")
    return value


def build_switch(text: str) -> str:
    """argparse type: NAME=VALUE, a -D switch of a kernel build (NAME an identifier)."""
    name, eq, _ = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"takes NAME=VALUE, got {text!r}")
    return text


def folder(text: str) -> Path:
    """argparse type: a folder, or a path where none exists yet (made when written)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


def output_folder(text: str) -> Path:
    """argparse type: a folder to write results into, made now (parents too), so that a bad path fails
    before the work whose result it would hold."""
    path = folder(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot use {text} as a folder ({e.strerror or e})") from None
    return path


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, a scheduler's stop) taken the way Ctrl-C is, under `sigterm_as_interrupt`."""


def _terminate(signum, frame):
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While it holds, SIGTERM raises `Terminated` (a KeyboardInterrupt) in the main thread, so a command
    cleans up as it does on Ctrl-C; elsewhere (a thread) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def interrupted_code(e: KeyboardInterrupt) -> int:
    """The exit code a shell reports for the signal behind `e`: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)


def make_folder(ap: argparse.ArgumentParser, path: Path, flag: str = "--out") -> Path:
    """Make the output folder (parents too) once every check has passed, so that a refused run leaves
    none behind (`output_folder` makes it while parsing); `ap.error`, one line, where it cannot be."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"argument {flag}: cannot use {path} as a folder ({e.strerror or e})")
    return Path(path)


def require_gpu(ap: argparse.ArgumentParser) -> None:
    """The GPU-only tools' first check: `ap.error` (one line, exit 2) where torch sees no CUDA device or
    CuPy is not installed, instead of a traceback from the first kernel."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        ap.error("this tool runs CUDA kernels, and torch sees no CUDA device here")
    if importlib.util.find_spec("cupy") is None:
        ap.error("this tool runs CUDA kernels through CuPy, which is not installed here")


def _usage() -> str:
    lines = ["usage: kdlib [--version] [--help] COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`kdlib COMMAND --help` shows a command's own arguments. `kdlib` alone prints this on",
              "stderr and exits 2 (no command given); `kdlib --help` prints it on stdout and exits 0."]
    return "\n".join(lines)


def _run(name: str, rest: list[str]) -> int:
    if name in ("-h", "--help", "--version") and rest:
        return fail("kdlib", f"{name} takes no arguments, got {' '.join(rest)}")
    if name in ("-h", "--help"):
        print(_usage())
        return 0
    if name == "--version":
        try:
            version = importlib.metadata.version("kdlib")
        except importlib.metadata.PackageNotFoundError:
            return fail("kdlib", "no package metadata for kdlib here (install it: pip install -e .)")
        print(f"kdlib {version}")
        return 0
    return int(importlib.import_module(COMMANDS[name][0]).cli(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(_usage(), file=sys.stderr)
        return EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS and name not in ("-h", "--help", "--version"):
        print(f"kdlib: error: unknown command {name!r} (commands: {', '.join(COMMANDS)}; see kdlib --help)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        rc = _run(name, rest)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left: point stdout at /dev/null so the interpreter's last flush has nowhere to fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return rc


if __name__ == "__main__":
    sys.exit(main())
