"""The throughput diagnosis (kdlib.diagnose): arithmetic on fakes, then against a real loopback server."""

import asyncio
import errno
import http.server
import json
import math
import threading
import time

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
    assert c.calls == [8, 264, 8, 264, 8, 264]  # the warm-up pair, then the timed pairs
    assert r["decomposition"]["available"] is False


class MeteredClient(FakeClient):
    """A DDTree endpoint with /metrics: a request's first `warm` steps accept 1 token each in `slow_ms`,
    every later step accepts 4 in `fast_ms` (the first token comes from the prefill)."""

    metric_set = "kdlib"

    def __init__(self, warm=3, slow_ms=30.0, fast_ms=10.0):
        super().__init__()
        self.warm, self.slow, self.fast = warm, slow_ms / 1e3, fast_ms / 1e3
        self.m = dict.fromkeys(dg.METRIC_SETS["kdlib"].values(), 0.0)

    def metrics(self):
        return dict(self.m)

    def complete(self, prompt, max_tokens, *, stream=False):
        names, done, t = dg.METRIC_SETS["kdlib"], 1, self.prefill
        for i in range(10**6):
            if done >= max_tokens:
                break
            acc, dt = (1, self.slow) if i < self.warm else (min(4, max_tokens - done), self.fast)
            done, t = done + acc, t + dt
            for key, v in (("accept_sum", acc), ("accept_count", 1), ("step_sum_s", dt), ("step_count", 1)):
                self.m[names[key]] += v
        return dg.Completion("x" * done, 10, done, max_tokens, t)


def test_two_point_decomposes_the_steps_its_rate_counts():
    """The snapshots bracketed the short requests too, so their slow first steps entered accepted length
    and step time though the rate cancels them: the two did not multiply to the rate."""
    r = dg.two_point(MeteredClient(), "p", repeats=2)
    d = r["decomposition"]
    assert r["tokens_per_s"] == pytest.approx(4 / 0.010)  # 256 tokens in 64 steps of 10 ms
    assert d["accepted_length"] == pytest.approx(4.0) and d["step_ms"] == pytest.approx(10.0)
    assert d["ratio"] == pytest.approx(1.0) and d["within_tolerance"] and d["steps"] == 2 * 64


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
    assert d["predicted_tok_s"] == pytest.approx(20.0) and d["ratio"] == pytest.approx(0.95)
    assert d["within_tolerance"]
    assert d["batch"] == 1.0 and d["predicted_aggregate_tok_s"] == pytest.approx(20.0)
    batched = dg.decompose(before, {**after, "kdlib_step_seconds_count": 10, "kdlib_step_seconds_sum": 1.5})
    # 10 request steps in 5 engine steps
    assert batched["batch"] == 2.0 and batched["step_ms"] == pytest.approx(100.0)
    assert batched["predicted_aggregate_tok_s"] == pytest.approx(30 / 0.5)
    assert dg.decompose(before, after, 30.0)["within_tolerance"] is False
    eng = dg.decompose({"accept_sum": 0, "accept_count": 0, "step_sum_s": 0, "step_count": 0},
                       {"accept_sum": 29, "accept_count": 10, "step_sum_s": 1.44, "step_count": 10},
                       metric_set="engine")
    assert eng["predicted_tok_s"] == pytest.approx(2.9 / 0.144)  # the seeds' arithmetic: ~20 t/s
    accepted, drafts = "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"
    v = dg.decompose({accepted: 0, drafts: 0}, {accepted: 190, drafts: 100}, metric_set="vllm")
    assert v["accepted_length"] == pytest.approx(2.9) and v["predicted_tok_s"] is None and not v["available"]
    assert dg.decompose(None, after)["available"] is False
    assert dg.decompose(before, before)["why"].startswith("no decode steps")
    # request steps counted but no engine step time (a scrape without the step histogram)
    no_time = dg.decompose(before, {k: v for k, v in after.items() if not k.startswith("kdlib_step")})
    assert not no_time["available"] and no_time["why"] == "no engine step time between the snapshots"


def test_parse_metrics_through_prometheus_client():
    text = ('# HELP kdlib_requests Finished\n# TYPE kdlib_requests counter\n'
            'kdlib_requests_total{status="ok"} 3.0\n'
            'kdlib_requests_total{status="error"} 1.0\n'
            'vllm:spec_decode_num_drafts_total{model_name="m"} 7 1700000\n'
            '# TYPE h histogram\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 3\nh_sum 4.5\nh_count 3\n'
            'plain_metric 2.5\n')
    m = dg.parse_metrics(text)
    assert m == {"kdlib_requests_total": 4.0, "vllm:spec_decode_num_drafts_total": 7.0, "h_sum": 4.5,
                 "h_count": 3.0, "plain_metric": 2.5}


def test_base_url_with_or_without_v1():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/ "):
        assert dg.split_base_url(url) == ("http://h:1", "http://h:1/v1")


def test_make_prompt_hits_the_length():
    c = FakeClient()
    p, n = dg.make_prompt(c, 100, "abcdefghij" * 10)
    assert n == 100 and c.prompt_tokens(p) == 100
    with pytest.raises(ValueError):
        dg.make_prompt(c, 0)


class DenseTailClient(FakeClient):
    """An endpoint whose text gets denser past its first 256 characters (a first guess of characters per
    token runs long) and that refuses, as vLLM does, a prompt past its context with an HTTP 400. It
    records every prompt it counted."""

    def __init__(self, limit):
        super().__init__()
        self.max_context, self.counted = limit, []

    def prompt_tokens(self, prompt):
        self.counted.append(prompt)
        n = min(len(prompt), 256) // 3 + max(0, len(prompt) - 256) * 2 // 5  # 1/3, then 2/5 a character
        if n + 1 > self.max_context:
            err = dg.DiagnoseError(f"HTTP 400: maximum context length is {self.max_context} tokens")
            err.status = 400
            raise err
        return n


def test_make_prompt_stays_inside_the_context_and_fresh_prompts_are_unseen():
    c = DenseTailClient(limit=32_768)
    p, n = dg.make_prompt(c, 32_768 - 264 - 8, "abcdefghij" * 100)  # the sweep's last point
    assert n <= 32_768 - 264 - 8 and n > 0.98 * (32_768 - 264 - 8)
    c.counted.clear()
    p, n = dg.make_prompt(c, 500, "abcdefghij" * 100, fresh=True)
    q, _ = dg.make_prompt(c, 500, "abcdefghij" * 100, fresh=True)
    nonce = p.split("\n", 1)[0]
    assert len(nonce) == dg.NONCE_DIGITS and nonce.isdigit() and nonce != q.split("\n", 1)[0]
    assert not any(sent.startswith(nonce) for sent in c.counted)  # no calibration request primed a cache
    with pytest.raises(ValueError, match="--max-context"):
        dg.diagnose(type("NoLimit", (FakeClient,), {"max_context": None})(), progress=False)


def test_context_sweep_lengths_double_up_to_the_limit():
    rows = dg.context_sweep(FakeClient(), max_context=1024, text="t" * 50, repeats=1, progress=False)
    assert [r["target_prompt_tokens"] for r in rows] == [64, 128, 256, 512, 1024 - 264 - 8]
    assert all(r["prompt_tokens"] + 264 <= 1024 for r in rows)


# ----------------------------------------------------------------------------- against the embedded server
@pytest.fixture(scope="module")
def server():
    eng = serve.Engine(serve.load_bundle(prefer_trained=False), threads=1, max_num_seqs=4, max_model_len=512)
    with serve.EmbeddedServer(eng) as srv:
        yield srv
    eng.close()


def test_openai_client_two_point_and_sustained_on_loopback(server):
    client = dg.OpenAIClient(server.url + "/v1")
    try:
        assert client.model == server.engine.name and client.max_context == 512 and client.root == server.url
        prompt, n = dg.make_prompt(client, 48)
        assert n == 48  # one character per token on the fallback tokenizer
        tp = dg.two_point(client, prompt, short=4, long=36, repeats=1)
        assert tp["completion_short"] == 4 and tp["completion_long"] == 36 and not tp["early_stop"]
        assert tp["tokens_per_s"] > 0
        d = tp["decomposition"]
        assert d["metric_set"] == "kdlib" and d["available"]
        assert 1 <= d["accepted_length"] <= 8 and d["batch"] == 1
        s = dg.sustained(client, prompt, 80, progress=False)
        assert s["completion_tokens"] == 80 and s["ttft_s"] > 0 and s["decode_tokens_per_s"] > 0
        assert s["chunks"] > 2 and s["decomposition"]["available"]
        assert sum(s["per_step"]["accepted"]) >= 80 - 1  # the prefill's token is no decode step's
        # the engine in process gives the same greedy text as the endpoint
        plain = client.complete(prompt, 20)
        via_engine = dg.EngineClient(server.engine).complete(prompt, 20, stream=True)
        assert via_engine.text == plain.text and via_engine.ttft_s > 0 and via_engine.completion_tokens == 20
    finally:
        client.close()


def test_load_mode_levels_rates_spread_and_greedy_check(server):
    client = dg.OpenAIClient(server.url)
    try:
        r = dg.load_test(client, concurrency=(1, 4), rates=(float("inf"),), max_concurrency=4, distinct=4,
                         num_prompts=8, input_len=16, output_len=12, repeats=2, slo={"e2e_ms": 1e6},
                         progress=False)
    finally:
        client.close()
    assert r["reference"]["prompts"] == 4 and len(r["reference"]["prompt_tokens"]) == 4
    assert [(lv["mode"], lv["concurrency"]) for lv in r["levels"]] == [("concurrency", 1), ("concurrency", 4),
                                                                         ("rate", 4)]
    for lv in r["levels"]:
        assert len(lv["runs"]) == 2
        for run in lv["runs"]:
            assert run["completed"] == run["requests"] == 8 and run["failed"] == 0 and run["early_stops"] == 0
            assert run["greedy_mismatches"] == 0  # concurrency changed no greedy output
            # every request meets a 1000 s target
            assert run["goodput"] == pytest.approx(run["request_throughput"])
            for fig in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                p = run[fig]
                assert 0 < p["p50"] <= p["p90"] <= p["p99"], fig
            assert run["output_throughput"] == pytest.approx(8 * 12 / run["duration_s"])
            d = run["decomposition"]
            assert d["available"] and d["metric_set"] == "kdlib" and d["measured_aggregate_tok_s"] > 0
        s = lv["summary"]
        tput = s["output_throughput"]
        assert tput["n"] == 2 and tput["min"] <= tput["mean"]
        assert s["decomposition.batch"]["mean"] >= 1
    assert r["levels"][1]["summary"]["decomposition.batch"]["mean"] > 1.5  # four streams step together
    assert "C=4" in dg.load_table(r)


def test_cli_load_mode_writes_json(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = dg.cli(["--endpoint", server.url + "/v1", "--load", "--concurrency", "2", "--repeats", "1",
                 "--distinct-prompts", "2", "--num-prompts", "2", "--input-len", "8", "--output-len", "6",
                 "--goodput", "ttft:0.001", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    run = res["levels"][0]["runs"][0]
    assert run["completed"] == 2 and run["goodput"] == 0.0  # nobody gets a first token within 1 microsecond
    printed = capsys.readouterr()
    assert "C=2" in printed.out and "failed" in printed.out.splitlines()[2] and "warning" not in printed.err
    with pytest.raises(SystemExit):
        dg.cli(["--load", "--goodput", "latency:5"])


@pytest.mark.parametrize("argv, message", [
    (["--json", "/nonexistent/folder/x.json"], "x.json: its folder /nonexistent/folder does not exist"),
    (["--endpoint", "http://127.0.0.1:9", "--serve-args=--random"], "--serve-args configures"),
    (["--serve-args", '"'], "--serve-args: No closing quotation"),
    (["--timeout", "inf"], "--timeout: must be a positive number"),
    (["--json", "/tmp"], "--json /tmp is a folder, not a file"),
    (["--sustained-prompt", "-5"], "--sustained-prompt must be positive"),
    (["--load", "--goodput", "ttft:-5"], "the milliseconds must be finite and > 0"),
    (["--load", "--goodput", "tpot:nan"], "the milliseconds must be finite and > 0"),
    (["--load", "--concurrency", ","], "--concurrency: a comma-separated list of values"),
    (["--load", "--concurrency", ""], "name no level to run"),
    # a flag of the other mode was parsed, checked and ignored
    (["--concurrency", "8", "--goodput", "ttft:5"], "--concurrency, --goodput apply to --load only"),
    (["--load", "--no-sweep"], "--no-sweep applies to the diagnosis without --load"),
    (["--sustained-tokens", "-1"], "--sustained-tokens must be >= 0"),
    (["--endpoint", "notaurl"], "--endpoint: 'notaurl' is not an http:// or https:// URL with a host"),
    (["--endpoint", "http://[::1"], "--endpoint: 'http://[::1' is not a valid URL (Invalid IPv6 URL)"),
    (["--endpoint", "http://127.0.0.1:99999"], "is not a valid URL (Port out of range"),
    (["--json", ""], "--json: an empty path"),
])
def test_cli_refuses_bad_arguments_before_any_request(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        dg.cli(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_cli_refuses_a_json_path_through_a_file_before_measuring(tmp_path, capsys):
    (tmp_path / "a.kdtr").write_bytes(b"x")
    with pytest.raises(SystemExit) as e:
        dg.cli(["--json", str(tmp_path / "a.kdtr" / "out.json")])
    assert e.value.code == 2 and "a.kdtr is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("serve_args", ["--random --port 18125", "--random --host=0.0.0.0", "--po 1"])
def test_cli_refuses_a_host_or_port_for_the_embedded_server(serve_args, capsys):
    """The launcher binds and polls its own port; the child's would win and leave it polling for 300 s."""
    assert dg.cli(["--serve-args", serve_args, "--no-sweep"]) == 2
    assert "the launcher sets the server's host and port itself" in capsys.readouterr().err


def test_unknown_model_and_dead_endpoint(server):
    import socket

    with pytest.raises(dg.DiagnoseError, match="not served"):
        dg.OpenAIClient(server.url, model="other")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(dg.DiagnoseError, match="cannot reach"):
        dg.OpenAIClient(f"http://127.0.0.1:{port}")


def test_cli_says_when_the_result_could_not_be_written(server, tmp_path, capsys, monkeypatch):
    """The write comes after the whole run: a disk that filled up meanwhile is one error line and exit 1,
    the table still printed (a traceback before)."""
    def full(result, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(dg, "write_json", full)
    rc = dg.cli(["--endpoint", server.url, "--no-sweep", "--sustained-tokens", "0", "--repeats", "1",
                 "--json", str(tmp_path / "diag.json")])
    printed = capsys.readouterr()
    assert rc == 1 and "two-point" in printed.out and "Traceback" not in printed.err
    last = printed.err.splitlines()[-1]
    assert last.startswith("kdlib diagnose: error: the result (printed above) was not written: [Errno 28]")


def test_cli_writes_json_and_table(server, tmp_path, capsys):
    out = tmp_path / "diag.json"
    rc = dg.cli(["--endpoint", server.url, "--no-sweep", "--sustained-tokens", "40",
                 "--sustained-prompt", "32", "--repeats", "1", "--json", str(out)])
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
    # The GPU machine has no FastAPI, uvicorn, prometheus_client or httpx: the in-process path must not
    # need them.
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


def test_a_server_that_never_answers_fails_within_the_timeout(capsys):
    """A port that takes connections and never replies (a hung server): --timeout bounds the wait."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # connections complete in the backlog; nobody reads them
        t0 = time.monotonic()
        rc = dg.cli(["--endpoint", f"http://127.0.0.1:{s.getsockname()[1]}", "--timeout", "1", "--no-sweep"])
        waited = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("kdlib diagnose: error: cannot reach") and waited < 30


class _Endpoint(http.server.BaseHTTPRequestHandler):
    """A misbehaving OpenAI-style endpoint: /v1/models lists "m", /metrics is an HTML page, a streamed
    completion sends `mode`'s stream: "garbage" (a malformed event after two chunks) or "trickle" (a chunk
    every 0.3 s, never silent for a read timeout)."""

    mode = "garbage"
    protocol_version = "HTTP/1.0"  # close-delimited bodies

    def log_message(self, *args):
        pass

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            models = {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "t",
                                                  "max_model_len": 4096}]}
            return self._send(200, "application/json", json.dumps(models).encode())
        return self._send(200, "text/html", b"<html>not metrics</html>")

    def do_POST(self):
        n = json.loads(self.rfile.read(int(self.headers["content-length"])))["max_tokens"]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": i + 1, "total_tokens": 5 + i}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            if self.mode == "garbage" and i == 1:
                self.wfile.write(b"data: {not json\n\n")
            if self.mode == "trickle":
                time.sleep(0.3)
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(params=["garbage", "trickle"])
def bad_endpoint(request):
    handler = type("Handler", (_Endpoint,), {"mode": request.param})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield request.param, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_malformed_or_endless_stream_fails_its_request_only(bad_endpoint):
    """A malformed event, or a stream that outlasts --timeout while never silent: the request fails with
    a DiagnoseError (one request) or is counted failed (the load mode), the run goes on; an HTML /metrics
    page is no metrics."""
    mode, url = bad_endpoint
    client = dg.OpenAIClient(url, timeout=1.0)
    try:
        assert client.metrics() is None
        t0 = time.monotonic()
        with pytest.raises(dg.DiagnoseError, match="malformed reply" if mode == "garbage" else "within 1 s"):
            client.complete("hello", 8, stream=True)
        assert time.monotonic() - t0 < 1.0 + 10  # bounded by the timeout, not the stream's end
        recs = asyncio.run(dg._load_run(client, ["hello"], [0, 0, 0], 8, concurrency=2, rate=None, seed=0))
        reason = "JSONDecodeError" if mode == "garbage" else "no complete reply within 1 s"
        assert all(not r["ok"] and reason in r["error"] for r in recs), recs
    finally:
        client.close()


def test_json_results_are_strict(tmp_path):
    """A request rate of inf ("all at once") and a NaN are written as JSON has them: "inf" and null."""
    dg.write_json({"request_rate": math.inf, "levels": [{"x": float("nan"), "y": -math.inf, "z": 1.5}]},
                  tmp_path / "r.json")

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    got = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert got == {"request_rate": "inf", "levels": [{"x": None, "y": "-inf", "z": 1.5}]}


def _stat(pid) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None where none is."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has ended


def _serve_children(pid: int) -> list[int]:
    """The live `kdlib serve` processes whose parent is `pid` (from /proc: Linux)."""
    import os

    kids = []
    for entry in os.listdir("/proc"):
        stat = _stat(entry) if entry.isdigit() else None
        if stat is None or stat[1] != str(pid) or stat[0] == "Z":
            continue
        try:
            with open(f"/proc/{entry}/cmdline") as f:
                if "serve" in f.read().split("\0"):
                    kids.append(int(entry))
        except OSError:
            continue  # it just ended
    return kids


@pytest.mark.parametrize("sig, code, how", [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")])
def test_a_signal_stops_the_embedded_server_too(sig, code, how):
    """SIGTERM on `kdlib diagnose` with its embedded `kdlib serve` ended it without stopping that server,
    which went on holding its port; Ctrl-C printed a traceback. Both now stop the server and end in one
    line with the shell's code. SIGINT goes to diagnose alone here (a terminal sends it to both)."""
    import os
    import signal
    import subprocess
    import sys

    # `kdlib`, with Ctrl-C's handler even where the runner ignores SIGINT
    kdlib_main = ("import signal, sys; from kdlib import cli; "
                  "signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(cli.main())")
    # --repeats: measuring outlasts the test's wait by far
    proc = subprocess.Popen([sys.executable, "-c", kdlib_main, "diagnose", "--no-sweep",
                             "--serve-args=--random --method ar", "--repeats", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kids = []
    try:
        for line in proc.stderr:  # printed once the server answers /health
            if line.startswith("kdlib diagnose: started the embedded server at "):
                break
        else:
            pytest.fail("kdlib diagnose ended before its server answered")
        kids = _serve_children(proc.pid)
        assert len(kids) == 1
        time.sleep(1)  # into the measurement
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=120)
        deadline = time.monotonic() + 60
        while _alive(kids[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(kids[0]), "the embedded server outlived kdlib diagnose"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in kids:  # an orphaned server: ours to end
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.endswith(f"kdlib diagnose: {how}; nothing measured is printed or "
                                                   "written\n")


def test_max_concurrency_needs_the_rate_sweep(server, tmp_path, capsys):
    """--max-concurrency caps the rate sweep only: with fixed levels alone it was taken, ignored, and written
    into the result's parameters."""
    with pytest.raises(SystemExit) as e:
        dg.cli(["--load", "--concurrency", "2", "--max-concurrency", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "--max-concurrency caps the rate sweep only: give --request-rate too" in err
    out = tmp_path / "rate.json"
    rc = dg.cli(["--endpoint", server.url, "--load", "--concurrency", "", "--request-rate", "50",
                 "--max-concurrency", "2", "--repeats", "1", "--distinct-prompts", "2", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "4", "--no-greedy-check", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["parameters"]["max_concurrency"] == 2 and res["levels"][0]["concurrency"] == 2


def test_level_flags_say_they_take_a_comma_list(capsys):
    """`--concurrency 1 2` failed with "unrecognized arguments: 2": the help now names the form."""
    with pytest.raises(SystemExit):
        dg.cli(["--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "--concurrency CONCURRENCY fixed concurrency levels, comma-separated, e.g. 1,2,4" in help_
    assert ("--request-rate REQUEST_RATE request rates per second to sweep, comma-separated, e.g. 1,2,inf"
            in help_)
