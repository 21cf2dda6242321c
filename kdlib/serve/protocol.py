"""Request bodies of the OpenAI surface as pydantic models (strict: "8" is no integer, true no number).

    CompletionRequest       POST /v1/completions
    ChatCompletionRequest   POST /v1/chat/completions
    error_from_validation(errors) -> RequestError   one 400 naming every bad field

Every field a client may send is declared; any other field is refused (400, code
"unsupported_field", the message names them). OpenAI fields this server cannot honour are
declared with their neutral value only (frequency_penalty 0, logit_bias {}, tools [], ...): that
value is accepted, any other one gets a 400 naming the field. null is the same as absent
everywhere except for `prompt` and `messages`, which are required, and completions' max_tokens.

Sampling fields: max_tokens (chat: max_completion_tokens first; absent: completions 16, as OpenAI and
vLLM, cut to the context; chat the rest of the context; null the rest of the context as in vLLM);
temperature (default 1.0 as OpenAI; below 1e-5 = greedy; at most float32's 3.4e38), top_p (0, 1], top_k
(0 or -1 = off, as is the vocabulary size or more), seed (absent = fresh randomness; choice i of n uses
seed + i), n 1..16, stop (a string or up to 4, each 1..MAX_STOP_CHARS characters; not included in the
output), ignore_eos, min_tokens (<= max_tokens; as vLLM, the stop tokens get no probability before it,
and stop strings count only from there), user (accepted, not used). Completions: logprobs
0..MAX_LOGPROBS (top alternatives per token), echo (with logprobs only where the engine has
`prompt_logprobs`; else a 400). Chat: logprobs (bool), top_logprobs 0..MAX_LOGPROBS; messages with role
system | developer | user | assistant, content a string or a list of text parts ({"type": "text",
"text": ...}), and an optional name (accepted; the template leaves it out).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from kdlib.serve.engine import RequestError

MAX_N = 16
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string: bounds the hold-back scan of every step
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs; OpenAI: 5 / 20)
MAX_NAMED = 10  # an error message names at most this many fields / problems
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"  # each message; then "<|assistant|>\n" for the reply
TEMPLATE_ROLE = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

Float = Annotated[float, Field(allow_inf_nan=False)]


def _neutral(name: str, ok) -> Any:
    """A field accepted at its neutral value only (`ok(v)` true), else a 400 naming it."""

    def check(cls, v):
        if v is not None and not ok(v):
            raise PydanticCustomError("unsupported", "only the neutral value is supported (got {value})",
                                      {"value": repr(v)[:80]})
        return v

    return field_validator(name)(check)


def _unicode(text: str) -> str:
    """`text`, refused if it holds a lone UTF-16 surrogate (JSON's "\\ud800"), which has no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_value", "holds a lone UTF-16 surrogate (U+{code}) at character "
                                  "{at}: not valid Unicode text", {"code": f"{ord(text[e.start]):04X}",
                                                                   "at": e.start}) from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, each chunk's choice's usage


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: Any = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None

    _frequency = _neutral("frequency_penalty", lambda v: v == 0)
    _presence = _neutral("presence_penalty", lambda v: v == 0)
    _repetition = _neutral("repetition_penalty", lambda v: v == 1)
    _bias = _neutral("logit_bias", lambda v: not v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise PydanticCustomError("invalid_type", "must be a string or a list of strings")
        if len(v) > MAX_STOPS:
            raise PydanticCustomError("invalid_value", f"at most {MAX_STOPS} strings, got {len(v)}")
        if any(not 1 <= len(s) <= MAX_STOP_CHARS for s in v):
            raise PydanticCustomError("invalid_value",
                                      f"each stop string must have 1..{MAX_STOP_CHARS} characters")
        return tuple(dict.fromkeys(_unicode(s) for s in v))

    @field_validator("model")
    @classmethod
    def _model(cls, v):
        return v if v is None else _unicode(v)  # the 404 for an unknown model quotes it

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info: ValidationInfo):
        # (here and below) a field that failed its own check is absent from info.data: no false second error
        if v is not None and "stream" in info.data and not info.data["stream"]:
            raise PydanticCustomError("invalid_value", "only allowed when 'stream' is true")
        return v


class CompletionRequest(_Sampling):
    """POST /v1/completions. prompt: a string, a list of one string, token ids, or a list of one id list."""

    prompt: Any
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    _suffix = _neutral("suffix", lambda v: v == "")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a batch of one, as OpenAI clients send
        if isinstance(v, str):
            return _unicode(v)
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise PydanticCustomError("invalid_type", "must be a string or a non-empty list of token ids "
                                  "(one prompt per request)")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v is not None and "n" in info.data and v != (info.data["n"] or 1):
            raise PydanticCustomError("unsupported", "only best_of = n is supported")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        return _unicode(v)


_PARTS = TypeAdapter(list[TextPart])  # its errors name the part: messages[0].content[1].text


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None  # OpenAI's participant name: accepted, and not part of the template

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if isinstance(v, str):
            return _unicode(v)
        if isinstance(v, list):
            for at, p in enumerate(v):
                if not isinstance(p, dict) or p.get("type") != "text":
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise PydanticCustomError("unsupported", "part {at}: only text parts (type 'text') are "
                                              "supported, got {kind}", {"at": at, "kind": repr(kind)})
            return "".join(p.text for p in _PARTS.validate_python(v))
        raise PydanticCustomError("invalid_type", "must be a string or a list of text parts")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    service_tier: str | None = None

    _format = _neutral("response_format", lambda v: v == {"type": "text"})
    _tools = _neutral("tools", lambda v: v == [])
    _tool_choice = _neutral("tool_choice", lambda v: v == "none")
    _store = _neutral("store", lambda v: v is False)
    _tier = _neutral("service_tier", lambda v: v in ("auto", "default"))

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info: ValidationInfo):
        if v is not None and "logprobs" in info.data and not info.data["logprobs"]:
            raise PydanticCustomError("invalid_value", "needs 'logprobs': true")
        return v


def render_chat(messages: list[Message]) -> str:
    """The prompt text of a chat: CHAT_TEMPLATE per message (developer as system), then the reply's header."""
    return "".join(CHAT_TEMPLATE.format(role=TEMPLATE_ROLE[m.role], content=m.content) for m in messages) \
        + "<|assistant|>\n"


_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")
_CODES = {"extra_forbidden": "unsupported_field", "missing": "missing_field", "json_invalid": "invalid_json",
          "unsupported": "unsupported", "invalid_value": "invalid_value"}


def _loc(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_from_validation(errors: list[dict]) -> RequestError:
    """One RequestError (400) for pydantic's errors (FastAPI's RequestValidationError.errors()):
    the message lists every problem (unsupported fields first), `param` and `code` name the first."""
    extra, problems, first = [], [], None
    for e in errors:
        kind = e.get("type", "")
        loc = () if kind == "json_invalid" else tuple(p for p in e.get("loc", ()) if p != "body")
        name = _loc(loc)
        if kind == "extra_forbidden":
            extra.append(name)
            continue
        first = first or (name, kind)
        if kind == "json_invalid":
            why = (e.get("ctx") or {}).get("error", e.get("msg"))
            problems.append(f"the request body is not valid JSON: {why}")
        elif not loc and kind in _NOT_AN_OBJECT and isinstance(e.get("input"), bytes | str):
            # FastAPI parses a body as JSON only under a JSON content type (curl -d sends a form's)
            problems.append("the request body was not read as JSON: send it with the header "
                            "Content-Type: application/json")
        elif not loc:
            problems.append("the request body must be a JSON object" if kind in _NOT_AN_OBJECT else
                            "the request body is empty" if kind == "missing" else
                            e.get("msg", "invalid body"))
        else:
            problems.append(f"{name}: {e.get('msg', 'invalid')}")
    if extra:
        more = f" and {len(extra) - MAX_NAMED} more" if len(extra) > MAX_NAMED else ""
        names = ", ".join(extra[:MAX_NAMED]) + more
        problems.insert(0, f"unsupported field{'s' if len(extra) > 1 else ''} {names}: this server cannot "
                        f"honour {'them' if len(extra) > 1 else 'it'}")
        first = (extra[0], "extra_forbidden")
    name, kind = first or ("", "")
    if not name and kind in (*_NOT_AN_OBJECT, "json_invalid", "missing"):  # "missing": an empty body
        code = "invalid_json"
    else:
        code = _CODES.get(kind) or ("invalid_type" if kind.endswith("_type") or kind == "literal_error"
                                    else "invalid_value")
    more = f"; and {len(problems) - MAX_NAMED} more problems" if len(problems) > MAX_NAMED else ""
    return RequestError("; ".join(problems[:MAX_NAMED]) + more, param=name or None, code=code)
