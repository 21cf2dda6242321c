"""The device-call scripts run here with stand-ins for the GPU's programs (python3, ncu, nvidia-smi on PATH
record their arguments and succeed): the commands each step would run, and what the call brings back."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEVERS = ROOT / "tools" / "attention_levers_gpu.sh"


@pytest.fixture
def stand_ins(tmp_path):
    """A PATH whose python3, ncu and nvidia-smi append their arguments (and KDLIB_NVRTC_OPTIONS) to calls.log
    and exit 0."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    for exe in ("python3", "ncu", "nvidia-smi"):
        p = bin_ / exe
        p.write_text(f'#!/bin/sh\necho "{exe} $* #opts=$KDLIB_NVRTC_OPTIONS" >>"{log}"\necho "{exe} ran"\n')
        p.chmod(0o755)
    return {"PATH": f"{bin_}:{os.environ['PATH']}", "log": log}


def _levers(out, env, *steps, extra=None):
    return subprocess.run(["bash", str(LEVERS), *steps], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": env["PATH"], "OUT": str(out), **(extra or {})})


def test_levers_script_runs_every_step_and_packs_what_it_made(tmp_path, stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "tests", "ab", "timeline", "phases", "ncu",
                  extra={"KDLIB_AB": "kernel_ab_four_warps:PLAN_SMALL_REQS=0"})
    assert res.returncode == 0, res.stderr
    calls = stand_ins["log"].read_text().splitlines()
    py = [c for c in calls if c.startswith("python3 ")]
    assert any("pytest -m gpu tests/test_cuda_attention.py tests/test_attention_timeline.py" in c
               and "plan_kernel or own_plan or reuse or traced_build" in c for c in py)
    assert any("kernel_ab.py run --version 10 --define PLAN_SMALL_REQS=0 --suite kernel_ab_four_warps" in c
               for c in py)
    timeline = [c for c in py if "--suite attention_timeline" in c]
    assert len(timeline) == 1 and timeline[0].endswith("#opts=")
    assert any("plan_phases.py phases" in c for c in py)
    profiled = [c for c in calls if c.startswith("ncu ") and "--import " not in c]
    assert [c.split("--queries ")[1].split()[0] for c in profiled] == ["65", "9"]
    assert all("regex:^tree_verify_v10_attend(_own)?$" in c and "SourceCounters" in c
               and c.endswith("#opts=-lineinfo") for c in profiled)
    r = out / "r"
    for name in ("ncu_src.8x65x200k.csv", "ncu_src.8x9x200k.csv", "ncu_src.8x9x200k.details.csv"):
        assert (r / name).read_text().startswith("ncu ran")  # the export's output, renamed
    summary = (r / "summary.txt").read_text().splitlines()
    steps = [s.split()[0] for s in summary if " rc=" in s]
    ncu = [f"ncu_src.{p}{e}" for p in ("8x65x200k", "8x9x200k") for e in ("", ".export", ".details")]
    assert steps == ["tests", "kernel_ab_four_warps", "timeline", "phases", *ncu]
    assert all(" rc=0 " in s for s in summary if " rc=" in s) and summary[-1].startswith("total ")
    with tarfile.open(out / "r.tgz") as t:
        assert "r/summary.txt" in t.getnames() and "r/ncu_src.8x9x200k.csv" in t.getnames()


def test_levers_script_profiles_another_impl_at_the_queries_given(tmp_path, stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "ncu", extra={"KDLIB_NCU_IMPL": "wgmma_v12", "KDLIB_NCU_QUERIES": "9"})
    assert res.returncode == 0, res.stderr
    profiled = [c for c in stand_ins["log"].read_text().splitlines()
                if c.startswith("ncu ") and "--import " not in c]
    assert len(profiled) == 1 and "regex:^tree_verify_v12_attend(_own)?$" in profiled[0]
    assert "--impl wgmma_v12 --heads 8 --queries 9 --prefix 200000" in profiled[0]
    assert "--section SpeedOfLight" in profiled[0] and "--section MemoryWorkloadAnalysis" in profiled[0]
    r = out / "r"
    assert (r / "ncu_src.v12.8x9x200k.csv").exists() and (r / "ncu_src.v12.8x9x200k.details.csv").exists()


def test_levers_script_runs_tests_timeline_and_phases_by_default(tmp_path, stand_ins):
    res = _levers(tmp_path / "out", stand_ins)
    assert res.returncode == 0, res.stderr
    summary = (tmp_path / "out" / "r" / "summary.txt").read_text().splitlines()
    assert [s.split()[0] for s in summary if " rc=" in s] == ["tests", "timeline", "phases"]
    assert not any(c.startswith("ncu ") for c in stand_ins["log"].read_text().splitlines())


def test_levers_script_runs_the_steps_named_and_the_switches_given(tmp_path, stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "ab", extra={"KDLIB_AB": "kernel_ab_x:FOO=2 kernel_ab_xy:FOO=2,BAR=1"})
    assert res.returncode == 0, res.stderr
    calls = stand_ins["log"].read_text().splitlines()
    ab = "python3 tools/kernel_ab.py run --version 10"
    assert [c for c in calls if c.startswith("python3 ")] == [
        f"{ab} --define FOO=2 --suite kernel_ab_x --out {out}/r #opts=",
        f"{ab} --define FOO=2 --define BAR=1 --suite kernel_ab_xy --out {out}/r #opts="]
    res = _levers(out, stand_ins, "ab", extra={"KDLIB_AB": "kernel_ab_y:FOO=1", "KDLIB_AB_VERSION": "12"})
    assert res.returncode == 0, res.stderr
    calls = stand_ins["log"].read_text().splitlines()
    assert calls[-1] == ("python3 tools/kernel_ab.py run --version 12 --define FOO=1 --suite kernel_ab_y "
                         f"--out {out}/r #opts=")


def test_levers_script_runs_the_one_pass_kernels_tests_the_suites_and_the_gpu_suite_in_two_shares(tmp_path,
                                                                                                   stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "v11", "v12", "probe", "suite", "rows", "rate", "shard1", "shard2")
    assert res.returncode == 0, res.stderr
    py = [c for c in stand_ins["log"].read_text().splitlines() if c.startswith("python3 ")]
    assert py == [
        "python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_kernel_constants.py "
        "tests/test_cluster_exchange.py -q -p no:cacheprovider -k v11 or cluster or wgmma_constants "
        f"--junitxml={out}/r/v11.xml #opts=",
        "python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_kernel_constants.py "
        f"-q -p no:cacheprovider -k v12 or wgmma_constants --junitxml={out}/r/v12.xml #opts=",
        f"python3 tools/v11_probe.py --out {out}/r --also wgmma_v12 --clusters #opts=",
        f"python3 -m kdlib.perf.run --suite attention --out {out}/r #opts=",
        f"python3 tools/rows_sweep.py --out {out}/r #opts=",
        f"python3 -m kdlib.perf.run --suite wgmma_rate --out {out}/r #opts=",
        *(f"python3 -m pytest -m gpu tests --shard {k}/2 -q -p no:cacheprovider "
          f"--junitxml={out}/r/shard{k}.xml #opts=" for k in (1, 2))]


def test_levers_script_tests_version_13_and_duels_it_beside_flashinfer(tmp_path, stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "v13", "duel")
    assert res.returncode == 0, res.stderr
    py = [c for c in stand_ins["log"].read_text().splitlines() if c.startswith("python3 ")]
    assert py == [
        "python3 -m pytest -m gpu tests/test_cuda_attention.py tests/test_kernel_constants.py "
        f"-q -p no:cacheprovider -k v13 or wgmma_constants --junitxml={out}/r/v13.xml #opts=",
        f"python3 -m kdlib.perf.run --suite attention --out {out}/r/duel #opts="]
    summary = (out / "r" / "summary.txt").read_text()
    assert "KDLIB_ATTENTION_IMPLS=wgmma_v13,wgmma_v10" in summary and "PYTHONPATH=/tmp/site:" in summary


def test_levers_script_probes_the_builds_named(tmp_path, stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "probe", extra={"KDLIB_PROBE_DEFINES": "wgmma_v12:A=1 B=2"})
    assert res.returncode == 0, res.stderr
    assert [c for c in stand_ins["log"].read_text().splitlines() if c.startswith("python3 ")] == [
        f"python3 tools/v11_probe.py --out {out}/r --also wgmma_v12 --define wgmma_v12:A=1 --define B=2 "
        "--clusters #opts="]


def test_levers_script_refuses_an_unknown_step_or_ab_without_switches_before_running_anything(tmp_path,
                                                                                              stand_ins):
    out = tmp_path / "out"
    res = _levers(out, stand_ins, "tests", "bench")
    assert res.returncode == 2 and "unknown step bench" in res.stderr
    res = _levers(out, stand_ins, "tests", "ab", extra={"KDLIB_AB": ""})
    assert res.returncode == 2 and "step ab needs KDLIB_AB" in res.stderr
    assert not out.exists() and not stand_ins["log"].exists()


@pytest.mark.parametrize("argv", [
    ["tools/moe_profile.py"],
    ["tools/plan_phases.py", "phases", "--out", "{tmp}/o"],
    ["tools/v11_probe.py", "--out", "{tmp}/o"],
    ["tools/rows_sweep.py", "--out", "{tmp}/o"],
    ["tools/verify_split.py", "--out", "{tmp}/o"],
    ["tools/verify_energy.py", "--out", "{tmp}/o"],
    ["tools/gather_pair.py", "--out", "{tmp}/o"],
    ["tools/gather_stage.py", "--out", "{tmp}/o"],
    ["tools/ncu_verify.py", "--impl", "wgmma_v10"],
    ["tools/kernel_ab.py", "run", "--version", "10", "--out", "{tmp}/o"],
    ["tools/sanitize_attention.py", "run", "--json", "{tmp}/o.json"],
    ["tools/racecheck_patterns.py", "run", "no_barrier"],
    ["-m", "kdlib.cuda.pipeline", "--no-pool"],
])
def test_gpu_tools_say_in_one_line_that_they_need_a_gpu(argv, tmp_path):
    """Where torch sees no CUDA device (this machine), each GPU-only entry point exits 2 with one line
    instead of a traceback from its first kernel (no cupy, no CUDA generator, ...)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    args = [a.format(tmp=tmp_path) for a in argv]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "torch sees no CUDA device here" in err[-1], err


@pytest.mark.parametrize("argv, says", [
    (["tools/verify_split.py", "--define", "TV_TRACE"], "--define: takes NAME=VALUE, got 'TV_TRACE'"),
    (["tools/verify_split.py", "--define", "1X=2"], "argument --define: takes NAME=VALUE, got '1X=2'"),
    (["tools/verify_energy.py", "--define", "=1"], "argument --define: takes NAME=VALUE, got '=1'"),
    (["tools/verify_energy.py", "--point", "8x9x200k"], "--point 8x9x200k: not a goal point (8x65x200k, 64x"),
    (["tools/verify_energy.py", "--seconds", "0.01"], "--seconds 0.01: take 0.2 to 20"),
    (["tools/gather_pair.py", "--seconds", "30"], "--seconds 30.0: take 0.2 to 20"),
    (["tools/gather_pair.py", "--reads", "0"], "argument --reads: must be a positive integer, got '0'"),
    (["tools/gather_stage.py", "--slots", "-3"], "argument --slots: must be a positive integer, got '-3'"),
    (["tools/gather_stage.py", "--arms", "cp16,bulk"],
     "argument --arms: arms must be a comma-separated subset of cp16, tma, dup, push, got 'cp16,bulk'"),
    (["tools/verify_energy.py", "--impl", "mma"], "--impl mma: not a whole-verify impl"),
])
def test_verify_tools_refuse_bad_arguments_in_one_line_and_make_no_folder(argv, says, tmp_path):
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, *argv, "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1] and not out.exists()


def test_kernel_ab_export_of_an_unknown_revision_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "tools/kernel_ab.py", "export", "no-such-revision"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no commit 'no-such-revision'" in proc.stderr.strip().splitlines()[-1]


def test_sanitize_script_stops_its_steps_within_the_budget_a_caller_gives(tmp_path, stand_ins):
    """Its steps' own limits summed past the callers' (290 s of racecheck under a 150 s call): the caller's
    kill came before the summary. A step past KDLIB_SANITIZE_BUDGET_S is recorded as out of time, not run."""
    cs = tmp_path / "bin" / "compute-sanitizer"
    cs.write_text("#!/bin/sh\necho 'compute-sanitizer stand-in'\n")
    cs.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": stand_ins["PATH"], "OUT": str(out), "KDLIB_SANITIZE_BUDGET_S": "0"}
    res = subprocess.run(["bash", "tools/sanitize_gpu.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 1 and (out / "warm.rc").read_text().strip() == "124"
    assert "no time left" in (out / "summary.txt").read_text()
    assert "sanitize_attention.py" not in stand_ins["log"].read_text()  # the driver never started


def _ncu_attend(tmp_path, env, *args):
    report = tmp_path / "report.txt"
    argv = ["bash", "tools/ncu_attend.sh", "^tree_verify_v10_attend(_own)?$", str(report), *args]
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": env["PATH"]})
    return res, report


def test_ncu_attend_profiles_the_kernels_named_with_the_sections_02b_reads(tmp_path, stand_ins):
    res, report = _ncu_attend(tmp_path, stand_ins, "--impl", "wgmma_v10", "--queries", "65")
    assert res.returncode == 0, res.stderr
    assert report.read_text() == "ncu ran\n"  # ncu's output is the report
    (call,) = stand_ins["log"].read_text().splitlines()
    assert "--kernel-name regex:^tree_verify_v10_attend(_own)?$ --launch-skip 1 --launch-count 1" in call
    for section in ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "SchedulerStats",
                    "WarpStateStats"):
        assert f"--section {section}" in call
    assert "python3 tools/ncu_verify.py --impl wgmma_v10 --queries 65 #opts=" in call


@pytest.mark.parametrize("says, code, rc", [("==WARNING== No kernels were profiled.", 0, 1),
                                            ("ncu failed", 3, 3)])
def test_ncu_attend_fails_where_no_kernel_is_profiled_or_ncu_fails(tmp_path, stand_ins, says, code, rc):
    ncu = tmp_path / "bin" / "ncu"
    ncu.write_text(f"#!/bin/sh\necho '{says}'\nexit {code}\n")
    res, report = _ncu_attend(tmp_path, stand_ins, "--impl", "wgmma_v10")
    assert res.returncode == rc and says in report.read_text()
    assert ("no kernel profiled" in res.stderr) == (rc == 1)


@pytest.mark.parametrize("script", ["tools/attention_record_gpu.sh", "tools/attention_gpu.sh"])
def test_the_attention_device_scripts_profile_through_ncu_attend(script):
    text = (ROOT / script).read_text()
    assert "bash tools/ncu_attend.sh" in text and "--section" not in text  # one copy of the sections
