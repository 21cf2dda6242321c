"""`make lab` for real: JupyterLab on loopback, a kernel started over its REST API, code run through the
kernel's websocket channels, and the server's log read for ipykernel's plain-text-TCP warning."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

websocket = pytest.importorskip("websocket")  # in the lock; absent on the GPU host
zmq = pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "kdlib-test-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(port: int, path: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def _execute(port: int, kernel: str, code: str) -> str:
    """`code` run on the kernel through the server's websocket -> its execute_result's text/plain."""
    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kernel}/channels?token={TOKEN}",
                                     timeout=60)
    try:
        mid = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": mid, "username": "test", "session": uuid.uuid4().hex,
                       "msg_type": "execute_request", "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False}}))
        while True:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != mid:
                continue
            if msg["msg_type"] == "error":
                raise AssertionError(f"the kernel raised: {msg['content']['ename']}")
            if msg["msg_type"] == "execute_result":
                return msg["content"]["data"]["text/plain"]
    finally:
        ws.close()


@pytest.fixture
def lab(tmp_path):
    """`make lab` on a free loopback port with a fixed token, Jupyter's config, data and runtime folders in
    tmp_path: (port, the server's log file)."""
    port, log = _free_port(), tmp_path / "lab.log"
    # a make of its own, not one under the make that runs the tests (make test)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env |= {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
            "JUPYTER_DATA_DIR": str(tmp_path / "data")}
    args = f"--no-browser --ip 127.0.0.1 --port {port} --IdentityProvider.token={TOKEN}"
    with open(log, "w") as out:
        proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                _api(port, "/api/status")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, f"make lab exited {proc.returncode}: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"no server after 90 s: {log.read_text()[-2000:]}"
                time.sleep(0.5)
        yield port, log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_make_lab_runs_code_on_its_kernels_sockets_encrypted(lab):
    port, log = lab
    kernel = _api(port, "/api/kernels", "POST", {"name": "python3"})["id"]
    assert _execute(port, kernel, "6 * 7") == "42"
    _api(port, f"/api/kernels/{kernel}", "DELETE")
    if zmq.has("curve"):  # the kernel got CurveZMQ keys: ipykernel prints no plain-text-TCP warning
        assert "without encryption" not in log.read_text(), log.read_text()[-2000:]
