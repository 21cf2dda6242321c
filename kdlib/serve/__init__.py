"""An OpenAI-compatible HTTP server around the batched engine: the workbook's embedded default endpoint.

    kdlib serve --port 8000 --max-num-seqs 16          # FastAPI + uvicorn, as vLLM and SGLang serve
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "def f("}'

    with EmbeddedServer() as srv:                      # in-process (a thread), on 127.0.0.1 and a free port
        openai.OpenAI(base_url=srv.url + "/v1", api_key="-").completions.create(...)
    with ServerProcess(["--random"]) as srv:           # `kdlib serve` as a child process: time against it
        ...

Routes:
  POST /v1/completions          prompt (a string or token ids) -> text_completion
  POST /v1/chat/completions     messages -> chat.completion, through protocol.CHAT_TEMPLATE
  GET  /v1/models, /v1/models/{id}   the served name(s); `max_model_len` and a `kdlib` block saying
                                which weights, drafter and tokenizer are in use (trained or random fallback)
  GET  /health                  {"status": "ok", running, waiting, kdlib}
  GET  /metrics                 Prometheus text (kdlib.serve.metrics: kdlib_* families and vLLM's names)

Continuous batching: one engine thread drives `kdlib.engine.batch.BatchEngine` (kdlib.serve.engine);
requests join the running batch between steps and leave when done, each with its own sampling
settings; greedy outputs under any concurrency equal the sequential ones. The engine's two step-time
levers are opt-in flags: `--async-scheduling` (vLLM's name: step k+1 runs on the device while the loop
reads step k's tokens) and `--enable-torch-compile` (SGLang's name; CUDA only); notebook 03, 7e, measures
both on the engine. With compile, greedy outputs under load are no longer held to the sequential ones:
inductor's fused kernels change with the batch's shape, and the serve suite counts the outputs that
moved (notebook 04). A client that
disconnects is cancelled before the next step and its KV slots freed. Admission: a bounded
waiting queue (429 with Retry-After), a body-size limit (413, from Content-Length before reading),
tokenisation in a worker thread (kdlib.serve.app). Request fields: kdlib.serve.protocol (pydantic;
unknown fields and values it cannot honour get a 400 naming them). Text and stop strings:
kdlib.serve.text. Models: kdlib.serve.bundle (the trained tiny models when present, else a random
fallback, and /v1/models says so). FastAPI, uvicorn, pydantic and prometheus_client are imported
only by the modules that serve HTTP; `Engine` runs in process without them.
"""

from kdlib.serve.bundle import FALLBACK_CONFIG, Bundle, ByteTokenizer, load_bundle
from kdlib.serve.engine import MAX_WAITING, TOTALS, Delta, Done, Engine, RequestError, Sequence, make_core
from kdlib.serve.server import EmbeddedServer, ServerProcess, bind, cli
from kdlib.serve.text import TextStream

__all__ = ["FALLBACK_CONFIG", "MAX_WAITING", "TOTALS", "Bundle", "ByteTokenizer", "Delta", "Done",
           "EmbeddedServer", "Engine", "RequestError", "Sequence", "ServerProcess", "TextStream", "bind",
           "cli", "load_bundle", "make_core"]
