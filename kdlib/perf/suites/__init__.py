"""The GPU and CPU suites of `python3 -m kdlib.perf.run`, one module each, and the environment
switches they share: a misspelt value is an error naming the variable, never a silent default.

A suite module sets CPU_ONLY (host-only: its file is <suite>.cpu.json on any machine) or CPU_OK (it runs
on the CPU where there is no CUDA device); any other needs a CUDA GPU, and `kdlib.perf.run` refuses it,
before measuring anything, on a machine where torch sees none."""

from __future__ import annotations

import os

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """$name as a switch: 1 / true / yes / on, 0 / false / no / off (any case); unset or empty: default."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _ON or raw in _OFF:
        return raw in _ON
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {_ON + _OFF}")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """$name as one of `choices`; unset or empty: default."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {choices}")
    return raw
