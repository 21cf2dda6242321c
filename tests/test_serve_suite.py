"""The `serve` perf suite's core (kdlib.perf.suites.serve): `kdlib serve` in a child process under
kdlib.diagnose's load mode, on CPU with the trained tiny models; on the GPU machine as a gpu test."""

import pytest

from kdlib import zoo
from kdlib.perf.suites import serve as suite


def _check(res, levels):
    sc = res["scaling"]["ddtree"]
    assert sorted(sc["aggregate_tok_s"]) == list(levels) and sc["aggregate_over_c1"][1] == pytest.approx(1.0)
    assert sc["goal"]["greedy_mismatches"] == 0 and sc["goal"]["concurrency"] == max(levels)
    lv = res["by_arm"]["ddtree"]["levels"]
    assert [x["concurrency"] for x in lv] == list(levels)
    runs = [r for x in lv for r in x["runs"]]
    assert all(r["completed"] == r["requests"] and r["decomposition"]["available"] for r in runs)
    return sc


def test_serve_suite_core_on_cpu():
    if not zoo.available():
        pytest.skip("the trained models are not in data/models/")
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    res = suite.measure("cpu", concurrency=(1, 2), repeats=1, input_len=8, output_len=8, distinct=2)
    sc = _check(res, (1, 2))
    assert sc["goal"]["met"] is False  # C = 2 is no C = 16
    info = res["model_info"]["kdlib"]
    assert info["source"] == "trained" and info["dtype"] == "float32"
    assert res["parameters"]["arms"] == {"ddtree": ["ddtree", "float32"]}


@pytest.mark.gpu
def test_serve_suite_core_on_gpu():
    pytest.importorskip("fastapi")  # with the wheels of tools/serve_wheels.txt on PYTHONPATH
    res = suite.measure("cuda", concurrency=(1, 4), repeats=1, input_len=32, output_len=32, distinct=4)
    sc = _check(res, (1, 4))
    assert res["model_info"]["kdlib"]["device"].startswith("cuda")
    assert sc["aggregate_tok_s"][4] > sc["aggregate_tok_s"][1]  # four streams batch


@pytest.mark.gpu
def test_serve_suite_with_the_step_levers_on_gpu():
    """--async-scheduling on CUDA: greedy outputs under load equal the sequential ones. With
    --enable-torch-compile too every request completes and the model card says both levers are on; its greedy
    outputs under load are not held to the sequential ones (inductor's kernels change with the batch's shape:
    the serve suite's full run, serve.levers.c38bec5.h200.json, counts the mismatches)."""
    pytest.importorskip("fastapi")
    arms = ("ddtree_bf16_async", "ddtree_bf16_async_compile")
    res = suite.measure("cuda", concurrency=(1, 4), repeats=1, input_len=32, output_len=32, distinct=4,
                        arms=arms)
    assert res["scaling"][arms[0]]["goal"]["greedy_mismatches"] == 0
    for arm in arms:
        info = res["by_arm"][arm]["model_info"]["kdlib"]
        assert info["async_scheduling"] is True and info["torch_compile"] is (arm == arms[1])
        assert all(r["completed"] == r["requests"] for lv in res["by_arm"][arm]["levels"] for r in lv["runs"])


def test_full_profile_leaves_out_the_cuda_only_arm_and_a_cpu_run_refuses_it(monkeypatch):
    assert "ddtree_bf16_async" in suite.FULL["arms"] and "ddtree_bf16_async_compile" not in suite.FULL["arms"]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match=r"ddtree_bf16_async_compile.*needs a CUDA device"):
        suite.run(arms=["ddtree_bf16_async_compile"])
