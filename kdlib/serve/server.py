"""Running the server: `kdlib serve` (cli), in a thread of this process, or as a child process.

    kdlib serve --port 8000 --max-num-seqs 16 --served-model-name tiny --api-key KEY
    with EmbeddedServer() as srv: ... srv.url ...           # uvicorn in a thread, 127.0.0.1, a free port
    with ServerProcess(["--random"]) as srv: ... srv.url    # `kdlib serve` as a child: what to time against

`kdlib serve` binds its socket first: a port in use is a one-line error and exit code 1 before
any model is loaded. It prints the address only once the engine has warmed up and uvicorn
serves on that socket.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from kdlib import DATA
from kdlib.cli import Parser, fail, interrupted_code, sigterm_as_interrupt
from kdlib.serve.app import MAX_BODY_BYTES, create_app
from kdlib.serve.bundle import DTYPES, FALLBACK_CONFIG, load_bundle
from kdlib.serve.engine import MAX_WAITING, Engine

SWITCH_INTERVAL_S = 0.0005  # the `kdlib serve` process's GIL switch interval: see cli()


def base_url(host: str, port: int) -> str:
    """http://host:port, an IPv6 address in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one); OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of such sockets. Without it
    # a kept-alive connection's next response waited ~40 ms (Nagle against the client's delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # TIME_WAIT only: a live listener still refuses
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


GRACE_S = 5  # seconds the requests in flight get to finish at shutdown, before the rest are answered 503


def _uvicorn(app, log_level: str, engine: Engine):
    """uvicorn's server whose shutdown first stops accepting, lets the requests in flight finish for
    GRACE_S, then has `engine` answer the rest 503 "shutdown" while the event loop still runs: a stream
    ends with an error event and [DONE], a plain request gets the JSON error. (uvicorn alone cancels the
    tasks left after its grace period: a plain-text 500, a stream cut mid-body.)"""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:
                server.close()
            deadline = time.monotonic() + GRACE_S
            while not self.force_exit and time.monotonic() < deadline and \
                    (engine.state()["running"] or engine.state()["waiting"]):
                await asyncio.sleep(0.05)
            engine.shutdown_requests()
            await super().shutdown(sockets)

    return Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                 timeout_graceful_shutdown=GRACE_S))


class EmbeddedServer:
    """uvicorn serving `create_app(engine)` in a background thread on host:port (port 0 = a free one).

    with EmbeddedServer() as srv: ... srv.url ...      # the engine is closed on exit when it made it

    Client and server share this process's GIL here, so a client timing a stream sees chunk
    arrival late by up to a switch interval per hand-over; for measurements use `ServerProcess`.
    """

    def __init__(self, engine: Engine | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, **engine_kw):
        self._own = engine is None
        self.engine = engine or Engine(**engine_kw)
        self.host, self.port = host, port
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self._server = self._thread = None

    @property
    def url(self) -> str:
        return base_url(self.host, self.port)

    def start(self) -> EmbeddedServer:
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self.engine.wait_ready()
        app = create_app(self.engine, api_key=self.api_key, max_body_bytes=self.max_body_bytes)
        self._server = _uvicorn(app, "warning", self.engine)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = None
        if self._own:
            self.engine.close()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess:
    """`kdlib serve` in a child process on 127.0.0.1 and a free port: a separate interpreter, as a
    real endpoint is, so the client's timings do not share a GIL with the engine.

    with ServerProcess(["--random"]) as srv: ... srv.url ...
    """

    def __init__(self, args: list[str] | None = None, host: str = "127.0.0.1", startup_s: float = 300.0,
                 env: dict | None = None):
        self.args, self.host, self.startup_s, self.env = list(args or []), host, startup_s, env
        # the launcher picks host and port and polls them: the child's own (argparse's prefixes too) would win
        own = [a for a in self.args if len(flag := a.split("=")[0]) > 3 and ("--host".startswith(flag) or
                                                                           "--port".startswith(flag))]
        if own:
            raise ValueError(f"{' '.join(own)}: the launcher sets the server's host and port itself")
        self.port = None
        self._proc = self._log = None

    @property
    def url(self) -> str:
        return base_url(self.host, self.port)

    def start(self) -> ServerProcess:
        import subprocess
        import tempfile

        import httpx

        with socket.socket() as s:  # a free port; released just before the child binds it
            s.bind((self.host, 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "kdlib.cli", "serve", "--host", self.host, "--port", str(self.port),
               *self.args]
        env = {**os.environ, **self.env} if self.env else None
        self._log = tempfile.TemporaryFile(mode="w+")  # the child's stderr: a pipe nobody reads would fill up
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log, text=True, env=env)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                err = self.log()[-2000:]
                self.stop()
                raise RuntimeError(f"kdlib serve exited with {rc}: {err}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kdlib serve did not answer /health on {self.url} within {self.startup_s:.0f} s")

    def log(self) -> str:
        """What the child wrote to stderr so far."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - it would not stop: kill our own child
                self._proc.kill()
                self._proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _at_least(lo: int):
    """argparse type: an integer >= lo."""

    def check(v: str) -> int:
        n = int(v)
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {n}")
        return n

    check.__name__ = "integer"  # argparse's "invalid integer value: ..."
    return check


_positive, _count = _at_least(1), _at_least(0)


def _port(v: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    n = _count(v)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0 to 65535), got {n}")
    return n


_port.__name__ = "port"  # argparse's "invalid port value: ..."


def _device(v: str) -> str:
    """argparse type: cpu, cuda or cuda:N, on a machine that has it."""
    import torch

    try:
        d = torch.device(v)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {v!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {v!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{v}: this machine has no CUDA device that torch can use")
    return v


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="kdlib serve", description="OpenAI-compatible HTTP server around the batched engine "
                "(continuous batching)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free one)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="model name(s) clients send; the first is the one /v1/models lists first "
                    "(default: the bundle's name)")
    ap.add_argument("--api-key", default=os.environ.get("KDLIB_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default $KDLIB_API_KEY; none = open)")
    ap.add_argument("--max-model-len", type=_positive, default=None,
                    help="context limit per request, prompt + completion (default: the model's)")
    ap.add_argument("--max-num-seqs", type=_positive, default=16, help="streams the engine runs at once")
    ap.add_argument("--max-waiting", type=_count, default=MAX_WAITING,
                    help="sequences allowed to wait for a stream (429 beyond; 0: none wait)")
    ap.add_argument("--max-body-bytes", type=_positive, default=MAX_BODY_BYTES,
                    help="request body limit (413)")
    ap.add_argument("--method", choices=["ddtree", "ar"], default="ddtree")
    ap.add_argument("--budget", type=_positive, default=None,
                    help="DDTree budget (default: the drafter's horizon)")
    ap.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations")
    ap.add_argument("--random", action="store_true",
                    help="serve the random fallback even when trained models exist")
    ap.add_argument("--config", default=None,
                    help=f"the random model's config under data/configs/ (default {FALLBACK_CONFIG}): with "
                         "--random, or where there are no trained models")
    ap.add_argument("--models", default=None, help="folder of the trained models (default data/models/)")
    ap.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: 1 on CPU)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="run step k+1 on the device while the host reads step k's tokens (the engine's "
                    "overlap; a finished request runs one step more, its tokens dropped)")
    ap.add_argument("--enable-torch-compile", action="store_true",
                    help="torch.compile the verify forward and the drafter inside the CUDA graphs (cuda "
                    "only; each new step shape compiles on its first step). Greedy outputs under load may "
                    "then differ from sequential ones: the fused kernels change with the batch's shape")
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return ap


def cli(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from kdlib import zoo

    if args.models is not None and not args.random:
        if not zoo.available(args.models):  # a mistyped folder must not serve the random fallback
            ap.error(f"--models {args.models} does not hold the trained models ({', '.join(zoo.FILES)})")
    if args.config is not None:
        if not (DATA / "configs" / f"{args.config}.json").is_file():
            known = sorted(p.stem for p in (DATA / "configs").glob("*.json"))
            ap.error(f"--config {args.config}: no such config under data/configs/ ({', '.join(known)})")
        if not args.random and zoo.available(args.models):  # it would be ignored: the trained models serve
            ap.error("--config picks the random model's config, and trained models are present: add --random")
    args.config = args.config or FALLBACK_CONFIG
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"kdlib serve: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    # The event loop must get the GIL between engine steps to send each step's chunks promptly; at the
    # default 5 ms switch interval a stream of 2-3 ms steps reaches the client in late bursts.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        bundle = load_bundle(args.device, prefer_trained=not args.random, config=args.config,
                             folder=args.models, dtype=args.dtype)
        engine = Engine(bundle, method=args.method, budget=args.budget, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, max_waiting=args.max_waiting, threads=args.threads,
                        served_names=tuple(args.served_model_name) if args.served_model_name else None,
                        overlap=args.async_scheduling, compile=args.enable_torch_compile)
    except (ValueError, OSError) as e:  # a bad model folder or option; an unreadable file
        sock.close()
        return fail("kdlib serve", e)
    try:
        engine.wait_ready()
        app = create_app(engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
        server = _uvicorn(app, args.log_level, engine)
        levers = [name for name, on in (("async scheduling", args.async_scheduling),
                                         ("torch.compile", args.enable_torch_compile)) if on]
        print(f"kdlib serve: {', '.join(engine.names)} ({bundle.info['weights']}; "
              + ", ".join([args.dtype, args.method, f"{args.max_num_seqs} streams",
                           f"context {engine.max_model_len}", *levers])
              + f") on {base_url(args.host, sock.getsockname()[1])}", flush=True)
        # uvicorn stops on SIGINT whatever its handler was, then re-raises it: a server started in the
        # background of a script (SIGINT ignored) would exit 0, not 130
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        with sigterm_as_interrupt():  # uvicorn re-raises the signal it stopped on: exit as a shell reports it
            server.run(sockets=[sock])
    except KeyboardInterrupt as e:
        return interrupted_code(e)
    finally:
        engine.close()
        sock.close()
    return 0
