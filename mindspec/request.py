"""One request -> `Pipeline.generate` keywords, shared by `mindspec serve` and `mindspec batch`.

A request is a flat dict: exactly one of "prompt" (text), "messages" (chat, rendered with the
model's chat template) or "prompt_ids" (token ids), plus any of FIELDS' sampling keys. Every HTTP
endpoint maps its own envelope onto this dict; a batch line is this dict itself. Missing keys
take the caller's defaults (the command line's flags). Range checks of the sampling numbers are
SamplingParams' (raised by generate before any work); this module checks what generate cannot:
the shapes of prompts, messages, stop strings and token counts.
"""
import os
import random

from .errors import MindspecError

SEED_ENV = "MINDSPEC_SEED_BASE"  # set by the tensor-parallel launcher: every rank draws the same seeds
_seeds = None

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
FIELDS = frozenset(PROMPT_FIELDS + (
    "chat", "max_new_tokens", "max_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
    "draft_temperature", "seed", "stop", "do_sample", "k"))


class RequestError(MindspecError):
    """A request the caller must fix; `status` is the HTTP code the server answers with."""

    def __init__(self, message, status=400):
        super().__init__(message)
        self.status = status


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _text(name, v):
    """A string the tokenizer can take: JSON may carry lone surrogates (\\ud800) that UTF-8 cannot."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name} is not valid Unicode text (a lone surrogate?)") from None
    return v


def _messages(v):
    """[{role, content}] with content a string or a list of {"type": "text", "text"} parts."""
    if not isinstance(v, list) or not v:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string \"role\"")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": _text(f"messages[{i}].content", content)})
    return out


def parse(req, defaults=None):
    """Validate a flat request and return the keywords for `run` (those of Pipeline.generate, with
    the prompt still as "prompt"/"messages"/"prompt_ids" + "chat"). A sampled request without a
    seed gets a drawn one, so the caller can report it and the run can be repeated."""
    if not isinstance(req, dict):
        raise RequestError("a request must be a JSON object")
    given = [f for f in PROMPT_FIELDS if req.get(f) is not None]
    if len(given) != 1:
        raise RequestError("give exactly one of \"prompt\", \"messages\" or \"prompt_ids\"")
    kw = {k: v for k, v in (defaults or {}).items() if v is not None}
    kw.update({k: v for k, v in req.items() if k in FIELDS and k not in PROMPT_FIELDS and v is not None})
    src = given[0]
    if src == "prompt":
        if not isinstance(req["prompt"], str) or not req["prompt"]:
            raise RequestError("prompt must be a non-empty string")
        kw["prompt"] = _text("prompt", req["prompt"])
    elif src == "messages":
        kw["messages"] = _messages(req["messages"])
    else:
        ids = req["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
            raise RequestError("prompt_ids must be a non-empty list of integer token ids")
        kw["prompt_ids"] = ids
    kw.pop("max_tokens", None)  # the OpenAI name of max_new_tokens
    name = next((f for f in ("max_new_tokens", "max_tokens") if req.get(f) is not None), "max_new_tokens")
    n = req.get(name, kw.get("max_new_tokens"))
    if n is not None:
        if not _is_int(n) or n < 1:
            raise RequestError(f"{name} must be an integer >= 1, got {n!r}")
        kw["max_new_tokens"] = n
    stop = kw.get("stop")
    if isinstance(stop, str):
        kw["stop"] = [stop]
    elif stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop must be a string or a list of strings")
    for s in kw.get("stop") or ():
        _text("stop", s)
    if "k" in kw and kw["k"] != "auto" and not _is_int(kw["k"]):
        raise RequestError(f"k must be an integer K bucket or \"auto\", got {kw['k']!r}")
    for flag in ("chat", "do_sample"):
        if not isinstance(kw.get(flag, False), bool):
            raise RequestError(f"{flag} must be true or false, got {kw[flag]!r}")
    do_sample = kw.pop("do_sample", None)
    if do_sample is False:  # TGI / MindIE: greedy whatever the other sampling fields say
        kw.update(temperature=0.0, top_k=0, top_p=1.0)
    elif do_sample and not kw.get("temperature"):
        kw["temperature"] = 1.0
    if isinstance(kw.get("temperature"), (int, float)) and kw["temperature"] > 0 and kw.get("seed") is None:
        kw["seed"] = _seed()
    return kw


def _seed():
    """A fresh seed; reproducible from SEED_ENV when it is set (ranks parse the same requests in order)."""
    global _seeds
    if _seeds is None:
        base = os.environ.get(SEED_ENV)
        _seeds = random.Random(int(base)) if base else random.Random()
    return _seeds.randrange(2 ** 31)


def make(pipe, kw, request_id=None):
    """The engine Request of parsed keywords. Chat messages are rendered with the model's template and
    tokenized exactly as `generate(prompt=..., chat=True)` does."""
    kw = dict(kw)
    messages = kw.pop("messages", None)
    prompt, prompt_ids, chat = kw.pop("prompt", None), kw.pop("prompt_ids", None), kw.pop("chat", False)
    if messages is not None:
        prompt, chat = pipe.tokenizer.apply_chat_template(messages), False
    if kw.get("k") == "auto" and pipe.engine is not None and pipe.engine.dynamic is None and pipe.k != "auto":
        raise RequestError(f"k=\"auto\" needs the pipeline started with dynamic K (this one runs K={pipe.k})")
    return pipe.request(prompt, prompt_ids, chat=chat, request_id=request_id, **kw)


def run(pipe, kw, on_text=None):
    """Generate for parsed keywords, alone: (prompt token ids, Result)."""
    r = make(pipe, kw)
    pipe.run([r], (lambda _, text: text and on_text(text)) if on_text else None)
    if r.error is not None:
        raise r.error
    return r.prompt_ids, r.result()
