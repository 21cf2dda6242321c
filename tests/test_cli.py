"""The `kdlib` console script as a user runs it: real subprocesses of the installed entry point
(`.venv/bin/kdlib`) and of `python -m kdlib`; every bad input is one line on stderr and exit 2."""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdlib import ROOT, cli

KDLIB = Path(sys.executable).parent / "kdlib"  # the console script pip installed beside this interpreter
MEMORY = ["memory", "kimi-k2.6", "--gpu", "h200", "--context", "1000"]


def run(*args: str, module: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kdlib", *args] if module else [str(KDLIB), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_console_script_is_installed():
    assert KDLIB.is_file() and os.access(KDLIB, os.X_OK), f"no kdlib script at {KDLIB} (pip install -e .)"


@pytest.mark.parametrize("module", [False, True])
def test_version_from_package_metadata(module):
    out = run("--version", module=module)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout == f"kdlib {importlib.metadata.version('kdlib')}\n"


def test_no_command_prints_the_commands_on_stderr_and_exits_2():
    out = run()
    assert out.returncode == 2 and out.stdout == ""
    for name in cli.COMMANDS:
        assert f"  {name} " in out.stderr
    helped = run("--help")
    assert helped.returncode == 0 and helped.stderr == "" and helped.stdout == out.stderr
    for flag in ("--help", "--version"):  # an argument after them was ignored, status 0
        extra = run(flag, "memory")
        assert extra.returncode == 2 and extra.stdout == ""
        assert extra.stderr == f"kdlib: error: {flag} takes no arguments, got memory\n"


BAD = [
    # (argv, the command's prefix, a phrase the one line must hold)
    (["nosuch"], "kdlib", "unknown command 'nosuch'"),
    (["estimate", "--concurrency", "0"], "kdlib estimate", "--concurrency: must be a positive integer"),
    (["estimate", "--concurrency", "4", "-3"], "kdlib estimate", "got '-3'"),
    (["estimate", "--concurrency", "two"], "kdlib estimate", "got 'two'"),
    (["estimate", "--context", "300000"], "kdlib estimate", "max_position_embeddings 262,144"),
    (["estimate", "--context", "0"], "kdlib estimate", "--context: must be a positive integer"),
    (["estimate", "--scenario", "seeds", "--gpu", "h200"], "kdlib estimate", "takes no --gpu;"),
    (["estimate", "--scenario", "seeds", "--calibrated"], "kdlib estimate", "takes no --calibrated;"),
    (["estimate", "--scenario", "seeds", "--concurrency", "4"], "kdlib estimate", "takes no --concurrency;"),
    (["estimate", "--scenario", "seeds", "--context", "4096", "--block-size", "4"], "kdlib estimate",
     "takes no --context, --block-size;"),
    (["estimate", "--block-size", "0"], "kdlib estimate", "--block-size: must be a positive integer"),
    (["estimate", "--block-size", "8", "--accepted-length", "9.5"], "kdlib estimate", "block + 1 = 9"),
    (["estimate", "--accepted-length", "0.5"], "kdlib estimate", "must lie in [1, block + 1"),
    (["estimate", "--block-size", "2"], "kdlib estimate", "(the default; give --accepted-length)"),
    (["estimate", "--accepted-length", "nan"], "kdlib estimate", "must be a positive number"),
    (["estimate", "--gpu", "a100"], "kdlib estimate", "unknown GPU 'a100'"),
    ([*MEMORY, "--tp", "8", "--weight-format", "int4_g0"], "kdlib memory", "positive integer group size"),
    ([*MEMORY, "--tp", "8", "--weight-format", "int4_gabc"], "kdlib memory", "positive integer group size"),
    ([*MEMORY, "--tp", "1024"], "kdlib memory", "tp=1024 cannot split its 64 attention heads"),
    ([*MEMORY, "--tp", "3"], "kdlib memory", "tp=3 cannot split its 64 attention heads"),
    (["memory", "qwen3-30b-a3b", "--gpu", "h200", "--context", "1", "--tp", "5", "--kv-split",
      "dp_attention"],
     "kdlib memory", "splits neither its 128 routed experts"),
    ([*MEMORY, "--tp", "8", "--overhead-gib", "500"], "kdlib memory", "overhead before weights, 500.00 GiB"),
    ([*MEMORY, "--tp", "8", "--overhead-gib", "-1"], "kdlib memory", "--overhead-gib: must be a number >= 0"),
    ([*MEMORY, "--tp", "8", "--mem-fraction-static", "1.0"], "kdlib memory", "must be a fraction in (0, 1)"),
    ([*MEMORY, "--tp", "0"], "kdlib memory", "--tp: must be a positive integer, got '0'"),
    ([*MEMORY, "--tp", "8", "--max-total-tokens", "0"], "kdlib memory", "--max-total-tokens: must be a"),
    (["memory", "kimi-k2.6", "--gpu", "h200", "--tp", "8", "--context", "-5"], "kdlib memory", "got '-5'"),
    (["memory", "nope", "--gpu", "h200", "--tp", "8", "--context", "1"], "kdlib memory", "no config 'nope'"),
    ([*MEMORY, "--tp", "8", "--kv-dtype", "int3"], "kdlib memory", "unknown dtype 'int3'"),
    ([*MEMORY, "--gpu", "a100", "--tp", "8"], "kdlib memory", "unknown GPU 'a100'"),
]


@pytest.mark.parametrize(("argv", "prog", "phrase"), BAD, ids=[" ".join(b[0][:1] + b[0][-2:]) for b in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, prog, phrase):
    out = run(*argv)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"{prog}: error: ") and phrase in lines[0], lines[0]


def test_python_dash_m_gives_the_same_error():
    out = run(*MEMORY, "--tp", "3", module=True)
    assert out.returncode == 2 and out.stderr == run(*MEMORY, "--tp", "3").stderr


def test_good_runs_still_print():
    out = run(*MEMORY, "--tp", "8", "--json")
    assert out.returncode == 0 and out.stderr == ""
    assert json.loads(out.stdout)["inputs"]["tp"] == 8
    out = run("estimate", "--scenario", "seeds", "--json")
    assert out.returncode == 0 and out.stderr == "" and len(json.loads(out.stdout)["scenarios"]) == 3


@pytest.mark.parametrize("argv", [[*MEMORY, "--tp", "8", "--json"], ["estimate", "--scenario", "seeds"],
                                  ["--help"], ["kdtr", "info", "data/golden/accept_sample.kdtr"]])
def test_a_reader_that_left_ends_the_command_quietly(argv):
    # stdout is a pipe whose read end is already closed: the first write meets EPIPE, as after `| head` exits
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([str(KDLIB), *argv], stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             timeout=120)
    finally:
        os.close(write)
    assert out.stderr == "" and out.returncode == cli.EXIT_BROKEN_PIPE == 141


@pytest.mark.parametrize(("kind", "good", "bad"), [
    (cli.positive_int, [("1", 1), ("64", 64)], ["0", "-2", "1.5", "x", ""]),
    (cli.positive_float, [("0.25", 0.25), ("3", 3.0)], ["0", "-1", "nan", "inf", "x"]),
    (cli.nonnegative_float, [("0", 0.0), ("1.5", 1.5)], ["-0.1", "nan", "-inf", "x"]),
    (cli.fraction, [("0.5", 0.5), ("0.999", 0.999)], ["0", "1", "1.2", "-0.3", "nan"]),
])
def test_argument_types(kind, good, bad):
    for text, value in good:
        assert kind(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            kind(text)


def test_folder_types(tmp_path):
    """`folder` takes a folder or a free path and makes nothing; `output_folder` makes it, parents too;
    both refuse a file, and `output_folder` a path it cannot make."""
    (tmp_path / "f").write_text("x")
    assert cli.folder(str(tmp_path)) == tmp_path
    assert cli.folder(str(tmp_path / "new")) == tmp_path / "new" and not (tmp_path / "new").exists()
    assert cli.output_folder(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()
    for kind in (cli.folder, cli.output_folder):
        with pytest.raises(argparse.ArgumentTypeError, match="is a file, not a folder"):
            kind(str(tmp_path / "f"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"cannot use .*sub as a folder \(Not a directory\)"):
        cli.output_folder(str(tmp_path / "f" / "sub"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "f"]
