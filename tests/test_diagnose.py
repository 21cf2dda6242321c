"""The throughput diagnosis (kdlib.diagnose): arithmetic on fakes, then against a real loopback server."""

import json

import pytest

from kdlib import diagnose as dg
from kdlib import serve


class FakeClient:
    """Deterministic endpoint: time = prefill + tokens / rate; may stop early."""

    metric_set = "none"
    model, max_context, info = "fake", 4096, {}

    def __init__(self, rate=100.0, prefill=0.5, stop_at=None):
        self.rate, self.prefill, self.stop_at, self.calls = rate, prefill, stop_at, []

    def metrics(self):
        return None

    def prompt_tokens(self, prompt):
        return len(prompt) // 3 + 1

    def complete(self, prompt, max_tokens, *, stream=False):
        self.calls.append(max_tokens)
        n = max_tokens if self.stop_at is None else min(max_tokens, self.stop_at)
        return dg.Completion("x" * n, self.prompt_tokens(prompt), n, max_tokens, self.prefill + n / self.rate)


def test_two_point_cancels_prefill():
    c = FakeClient(rate=80.0, prefill=3.0)
    r = dg.two_point(c, "p" * 300, repeats=2)
    assert r["tokens_per_s"] == pytest.approx(80.0) and not r["early_stop"]
    assert c.calls == [8, 8, 264, 8, 264]  # warm-up, then alternating pairs
    assert r["decomposition"]["available"] is False


def test_two_point_flags_early_stop_and_uses_returned_tokens():
    r = dg.two_point(FakeClient(rate=50.0, stop_at=100), "p", repeats=1)
    assert r["early_stop"] and "stopped early" in r["warning"]
    assert r["tokens_per_s"] == pytest.approx(50.0)  # (100 - 8) / ((100 - 8) / 50)
    assert r["nominal_tokens_per_s"] == pytest.approx(256 / (92 / 50))  # what the naive 256 / dt would claim


def test_two_point_rejects_bad_points():
    with pytest.raises(ValueError):
        dg.two_point(FakeClient(), "p", short=10, long=10)
    with pytest.raises(ValueError):
        dg.two_point(FakeClient(), "p", repeats=0)


def test_decompose_kdlib_engine_vllm_and_none():
    before = {"kdlib_spec_accept_length_sum": 10, "kdlib_spec_accept_length_count": 5,
              "kdlib_step_seconds_sum": 1.0, "kdlib_step_seconds_count": 5}
    after = {"kdlib_spec_accept_length_sum": 40, "kdlib_spec_accept_length_count": 15,
             "kdlib_step_seconds_sum": 2.5, "kdlib_step_seconds_count": 15}
    d = dg.decompose(before, after, measured_tok_s=19.0, metric_set="kdlib")
    assert d["accepted_length"] == 3.0 and d["step_ms"] == pytest.approx(150.0)
    assert d["predicted_tok_s"] == pytest.approx(20.0) and d["ratio"] == pytest.approx(0.95) and d["within_tolerance"]
    assert dg.decompose(before, after, 30.0)["within_tolerance"] is False
    eng = dg.decompose({"accept_sum": 0, "accept_count": 0, "step_sum_s": 0, "step_count": 0},
                       {"accept_sum": 29, "accept_count": 10, "step_sum_s": 1.44, "step_count": 10}, metric_set="engine")
    assert eng["predicted_tok_s"] == pytest.approx(2.9 / 0.144)  # the seeds' arithmetic: ~20 t/s
    v = dg.decompose({"vllm:spec_decode_num_accepted_tokens_total": 0, "vllm:spec_decode_num_drafts_total": 0},
                     {"vllm:spec_decode_num_accepted_tokens_total": 190, "vllm:spec_decode_num_drafts_total": 100},
                     metric_set="vllm")
    assert v["accepted_length"] == pytest.approx(2.9) and v["predicted_tok_s"] is None and not v["available"]
    assert dg.decompose(None, after)["available"] is False
    assert dg.decompose(before, before)["why"].startswith("no decode steps")


def test_parse_metrics_sums_label_sets_and_skips_comments():
    text = ('# HELP x y\n# TYPE kdlib_requests_total counter\nkdlib_requests_total{status="ok"} 3.0\n'
            'kdlib_requests_total{status="error"} 1.0\nvllm:spec_decode_num_drafts_total{model_name="m"} 7 1700000\n'
            'plain_metric 2.5\n')
    m = dg.parse_metrics(text)
    assert m == {"kdlib_requests_total": 4.0, "vllm:spec_decode_num_drafts_total": 7.0, "plain_metric": 2.5}


def test_make_prompt_hits_the_length():
    c = FakeClient()
    p, n = dg.make_prompt(c, 100, "abcdefghij" * 10)
    assert n == 100 and c.prompt_tokens(p) == 100
    with pytest.raises(ValueError):
        dg.make_prompt(c, 0)


def test_context_sweep_lengths_double_up_to_the_limit():
    rows = dg.context_sweep(FakeClient(), max_context=1024, text="t" * 50, repeats=1, progress=False)
    assert [r["target_prompt_tokens"] for r in rows] == [64, 128, 256, 512, 1024 - 264 - 8]
    assert all(r["prompt_tokens"] + 264 <= 1024 for r in rows)


# ----------------------------------------------------------------------------- against the embedded server
@pytest.fixture(scope="module")
def server():
    eng = serve.Engine(serve.load_bundle(prefer_trained=False), threads=1)
    with serve.EmbeddedServer(eng) as srv:
        yield srv
    eng.close()


def test_openai_client_two_point_and_sustained_on_loopback(server):
    client = dg.OpenAIClient(server.url)
    try:
        assert client.model == server.engine.name and client.max_context == 1024
        prompt, n = dg.make_prompt(client, 48)
        assert n == 48  # one character per token on the fallback tokenizer
        tp = dg.two_point(client, prompt, short=4, long=36, repeats=1)
        assert tp["completion_short"] == 4 and tp["completion_long"] == 36 and not tp["early_stop"]
        assert tp["tokens_per_s"] > 0
        d = tp["decomposition"]
        assert d["metric_set"] == "kdlib" and d["available"] and 1 <= d["accepted_length"] <= 8
        s = dg.sustained(client, prompt, 80, progress=False)
        assert s["completion_tokens"] == 80 and s["ttft_s"] > 0 and s["decode_tokens_per_s"] > 0
        assert s["chunks"] > 2 and s["decomposition"]["available"]
        assert sum(s["per_step"]["accepted"]) >= 79
        # the engine in process gives the same greedy text as the endpoint
        plain = client.complete(prompt, 20)
        via_engine = dg.EngineClient(server.engine).complete(prompt, 20, stream=True)
        assert via_engine.text == plain.text and via_engine.ttft_s > 0
    finally:
        client.close()


def test_unknown_model_and_dead_endpoint(server):
    import socket

    with pytest.raises(dg.DiagnoseError, match="not served"):
        dg.OpenAIClient(server.url, model="other")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(dg.DiagnoseError, match="cannot reach"):
        dg.OpenAIClient(f"http://127.0.0.1:{port}")


def test_cli_writes_json_and_table(server, tmp_path, capsys):
    out = tmp_path / "diag.json"
    rc = dg.cli(["--endpoint", server.url, "--no-sweep", "--sustained-tokens", "40", "--sustained-prompt", "32",
                 "--repeats", "1", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["two_point"]["completion_long"] == 264 and res["sustained"]["completion_tokens"] == 40
    printed = capsys.readouterr().out
    assert "two-point" in printed and "sustained 40" in printed


def test_cli_reports_an_endpoint_error(server, capsys):
    rc = dg.cli(["--endpoint", server.url, "--model", "nope", "--no-sweep"])
    assert rc == 1 and "not served" in capsys.readouterr().err


def test_seed_arithmetic():
    a = dg.seed_arithmetic()
    assert a["product_tok_s"] == pytest.approx(20.14, abs=0.01)  # 2.9 / 0.144 s, not 32
    assert a["implied_accept"] == pytest.approx(4.608) and a["implied_step_ms"] == pytest.approx(90.625)
    assert a["product_tok_s"] < a["linear_product_tok_s"] < dg.SEED_FIGURES["observed_tok_s"]


def test_diagnosis_suite_core_on_cpu():
    from kdlib.perf.suites import diagnosis

    r = diagnosis.measure("cpu", prompt_tokens=32, sustained_tokens=40, repeats=1, sweep_max=64, long=40,
                          prefer_trained=False)
    assert [s["target_prompt_tokens"] for s in r["sweep"]] == [64]
    row = r["by_kind"]["pydoc"]
    assert row["prompt_tokens"] == 32 and row["sustained"]["completion_tokens"] == 40
    d = row["sustained"]["decomposition"]
    assert d["available"] and d["metric_set"] == "engine" and d["ratio"] > 0
    assert row["two_point"]["completion_long"] == 40


def test_suite_core_needs_no_server_packages(monkeypatch):
    # The GPU machine has no FastAPI, uvicorn, prometheus_client or httpx: the in-process path must not need them.
    import sys

    from kdlib.perf.suites import diagnosis

    for m in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
        monkeypatch.setitem(sys.modules, m, None)
    r = diagnosis.measure("cpu", prompt_tokens=24, sustained_tokens=24, repeats=1, sweep_max=0, long=24,
                          prefer_trained=False)
    assert r["sweep"] == [] and r["by_kind"]["pydoc"]["sustained"]["decomposition"]["available"]


@pytest.mark.gpu
def test_diagnosis_suite_core_on_gpu():
    from kdlib.perf.suites import diagnosis

    r = diagnosis.measure("cuda", prompt_tokens=32, sustained_tokens=48, repeats=1, sweep_max=64, long=40)
    assert r["model_info"]["kdlib"]["device"].startswith("cuda")
    for row in r["by_kind"].values():
        assert row["sustained"]["completion_tokens"] == 48 and row["sustained"]["decomposition"]["available"]
