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
import sys

from .errors import MindspecError, is_int, is_number, parse_json, shown

SEED_ENV = "MINDSPEC_SEED_BASE"  # set by the tensor-parallel launcher: every rank draws the same seeds
_seeds = None

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
FIELDS = frozenset(PROMPT_FIELDS + (
    "chat", "max_new_tokens", "max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "draft_temperature", "seed", "stop", "do_sample",
    "k", "min_tokens", "ignore_eos",
    "stop_token_ids", "logprobs", "truncate_prompt_tokens"))
ROLES = ("system", "developer", "user", "assistant")
MAX_STOPS = 32  # stop strings a request may give (OpenAI allows 4, TGI 4 by default, vLLM any number)


class RequestError(MindspecError):
    """A request the caller must fix; `status` is the HTTP code the server answers with."""

    def __init__(self, message, status=400, param=None):
        super().__init__(message)
        self.status, self.param = status, param  # param: the field at fault (OpenAI's error.param)


def int_list(v):
    """Whether v is a list of integer token ids. A JSON integer's type is checked first: is_int's
    isinstance (numpy's integers too) costs ~1.8 µs an item."""
    return isinstance(v, list) and all(type(i) is int or is_int(i) for i in v)


def _count(name, n, param=None):
    """n, a token count (max_tokens or one of its other names)."""
    if not is_int(n) or n < 1:
        raise RequestError(f"{name} must be an integer >= 1, got {shown(n)}", param=param)
    return n


def prompt_cut(name, n):
    """n, a number of the prompt's last tokens to keep (vLLM's truncate_prompt_tokens, TGI's truncate), or None."""
    return None if n is None else _count(name, n, param=name)


def checked_text(name, v):
    """A string the tokenizer can take: JSON may carry lone surrogates (\\ud800) that UTF-8 cannot."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name} is not valid Unicode text (a lone surrogate?)") from None
    return v


def loads(data):
    """A request's JSON (a body or a batch line); ValueError (a message fit for the user) when it is not
    JSON, RequestError for a key given twice (which one counts differs between parsers: a gateway that
    checked the first would pass a request that runs with the last), its param the key when it is a
    top-level one (a nested object's path is not known here)."""
    twice = []  # (the first key given twice, the object it is in)

    def hook(pairs):
        obj = dict(pairs)
        if len(obj) < len(pairs) and not twice:
            seen = set()
            twice.append((next(k for k, _ in pairs if k in seen or seen.add(k)), obj))
        return obj
    if isinstance(data, (bytes, bytearray)):  # UTF-8 alone (RFC 8259; Python's json guessed UTF-16 and UTF-32 too: a
        try:  # gateway checking the body as UTF-8 saw another request), a BOM allowed as before
            data = bytes(data).decode("utf-8-sig")
        except UnicodeDecodeError as e:
            at = e.start + 3 * data.startswith(b"\xef\xbb\xbf")  # (counted after the BOM)
            raise ValueError(f"it is not UTF-8 text (byte 0x{e.object[e.start]:02x} at {at})") from None
    try:
        out = parse_json(data, object_pairs_hook=hook)
    except ValueError as e:
        if "integer string conversion" in str(e):  # int()'s limit, in words that are not about Python
            raise ValueError(f"a number of more than {sys.get_int_max_str_digits()} digits") from None
        raise
    if twice:
        key, where = twice[0]
        raise RequestError(f"the key {shown(key)} is given twice", param=key if where is out else None)
    return out


def stop_strings(stop):
    """stop (None, a string or a list of strings) as a list: a string is one stop string, not its
    characters; at most MAX_STOPS (each is looked for after every token, on the engine's thread)."""
    if stop is None:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise RequestError(f"stop must be a string or a list of strings, got {shown(stop)}")
    if len(stop) > MAX_STOPS:
        raise RequestError(f"stop: at most {MAX_STOPS} strings, got {len(stop)}", param="stop")
    if "" in stop:  # (it would match everywhere; was dropped without a word)
        raise RequestError("stop cannot contain an empty string", param="stop")
    return [checked_text("stop", s) for s in stop]


def _messages(v):
    """[{role, content}] with content a string or a list of {"type": "text", "text"} parts."""
    if not isinstance(v, list) or not v:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string \"role\"")
        if m["role"] not in ROLES:
            raise RequestError(f"messages[{i}].role {shown(m['role'])} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            for j, p in enumerate(content):
                if not (isinstance(p, dict) and p.get("type") == "text"):
                    raise RequestError(f"messages[{i}].content: only text parts are supported")
                if not isinstance(p.get("text"), str):
                    raise RequestError(f"messages[{i}].content[{j}].text must be a string")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        # (OpenAI's "developer" messages take the place of "system" ones: a template knows the latter)
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": checked_text(f"messages[{i}].content", content)}
        if m.get("name") not in (None, "") and not isinstance(m["name"], str):
            raise RequestError(f"messages[{i}].name must be a string")
        if m.get("name"):  # the chat template's to use (as vLLM passes it)
            msg["name"] = checked_text(f"messages[{i}].name", m["name"])
        for key, value in m.items():  # fields nothing would read; null or empty: unused
            if key not in msg and value not in (None, "", [], {}):
                raise RequestError(f"messages[{i}].{repr(key)[1:-1][:40]} is not supported (a message gives "
                                   f"\"role\", \"content\" and \"name\")", param="messages")
        out.append(msg)
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
    src = given[0]
    # (a job's --chat wraps its text prompts: not the lines of ids or messages beside them)
    kw = {k: v for k, v in (defaults or {}).items() if v is not None and (k != "chat" or src == "prompt")}
    kw.update({k: v for k, v in req.items() if k in FIELDS and k not in PROMPT_FIELDS and v is not None})
    if src == "prompt":
        if not isinstance(req["prompt"], str) or not req["prompt"]:
            raise RequestError("prompt must be a non-empty string")
        kw["prompt"] = checked_text("prompt", req["prompt"])
    elif src == "messages":
        kw["messages"] = _messages(req["messages"])
    else:
        ids = req["prompt_ids"]
        if not ids or not int_list(ids):
            raise RequestError("prompt_ids must be a non-empty list of integer token ids")
        kw["prompt_ids"] = ids
    limits = ("max_new_tokens", "max_tokens", "max_completion_tokens")  # the last two: OpenAI's names of it
    for f in limits[1:]:
        kw.pop(f, None)
    named = [f for f in limits if req.get(f) is not None]
    if len({_count(f, req[f]) for f in named}) > 1:  # (each one's type first; the same value twice: proxies send it)
        raise RequestError(f"give one of {named[0]} or {named[1]}, not both", param=named[1])
    name = named[0] if named else "max_new_tokens"
    n = req.get(name, kw.get("max_new_tokens"))
    if n is not None:
        kw["max_new_tokens"] = _count(name, n)
        if req.get(name) is not None:
            kw["limit_field"] = name  # asked for explicitly: more than the cache holds is an error, not a cut
    least, most = kw.get("min_tokens", 0), kw.get("max_new_tokens")
    if not is_int(least) or not 0 <= least <= (2 ** 31 if most is None else most):
        span = f"in [0, {2 ** 31}]" if most is None else \
            f"in [0, {most}] ({name if named else 'the default max tokens'})"
        raise RequestError(f"min_tokens must be an integer {span}, got {shown(least)}")
    prompt_cut("truncate_prompt_tokens", kw.get("truncate_prompt_tokens"))
    ids = kw.get("stop_token_ids")
    if ids is not None and not int_list(ids):
        raise RequestError("stop_token_ids must be a list of integer token ids")
    if kw.get("stop") is not None:
        kw["stop"] = stop_strings(kw["stop"])
    if "k" in kw and kw["k"] != "auto" and not is_int(kw["k"]):
        raise RequestError(f"k must be an integer K bucket or \"auto\", got {shown(kw['k'])}")
    for flag in ("chat", "do_sample", "ignore_eos"):
        if not isinstance(kw.get(flag, False), bool):
            raise RequestError(f"{flag} must be true or false, got {shown(kw[flag])}")
    do_sample = kw.pop("do_sample", None)
    if do_sample is False and not _warps(req):  # TGI's rule: sampling = do_sample or a field that changes the logits
        kw.update(temperature=0.0, top_k=0, top_p=1.0)  # (its text_generation client sends do_sample false always)
    elif do_sample and req.get("temperature") == 0:  # TGI's rule: sampling needs a temperature
        raise RequestError("temperature must be > 0 when do_sample is true")
    elif do_sample is not None and req.get("temperature") is None and not kw.get("temperature"):
        kw["temperature"] = 1.0  # the client's missing temperature, not the server's greedy default
    if isinstance(kw.get("temperature"), (int, float)) and kw["temperature"] > 0 and kw.get("seed") is None:
        kw["seed"] = draw_seed()
    return kw


def _warps(req):
    """TGI's test of whether a request samples though its do_sample is false: a temperature other than 1, a top_k,
    or a top_p or typical_p below 1 (values of another type are refused later)."""
    t, k, p, typical = (v if is_number(v := req.get(f)) else None for f in ("temperature", "top_k", "top_p", "typical_p"))
    return (t is not None and t != 1) or k not in (None, 0, -1) or any(v is not None and v < 1 for v in (p, typical))


def draw_seed():
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
    limit_field, min_tokens = kw.pop("limit_field", None), kw.pop("min_tokens", 0)
    max_input = kw.pop("max_input_tokens", None)  # a server's limit (MindIE's maxInputTokenLen)
    ignore_eos, stop_ids = kw.pop("ignore_eos", False), kw.pop("stop_token_ids", None) or []
    messages = kw.pop("messages", None)
    field = kw.pop("prompt_field", None) or ("prompt" if messages is None else "messages")  # (an error's param)
    prompt, prompt_ids, chat = kw.pop("prompt", None), kw.pop("prompt_ids", None), kw.pop("chat", False)
    if messages is not None:
        prompt, chat = pipe.tokenizer.apply_chat_template(messages), False
    cut = kw.pop("truncate_prompt_tokens", None)
    if cut is not None:  # the prompt's last `cut` tokens (vLLM's truncate_prompt_tokens, TGI's truncate)
        prompt, prompt_ids, chat = None, pipe.encode(prompt, prompt_ids, chat, pipe.max_positions)[-cut:], False
    r = pipe.request(prompt, prompt_ids, chat=chat, request_id=request_id, **kw)
    if max_input and len(r.prompt_ids) > max_input:
        raise RequestError(f"prompt is {len(r.prompt_ids)} tokens, more than this server's limit of {max_input}",
                           param=field)
    limit = pipe.max_positions  # as Pipeline.request's prompt check
    left = limit - len(r.prompt_ids)
    # as vLLM: asking for more than fits is an error; a default is cut to what fits (Pipeline.request)
    if limit_field and kw["max_new_tokens"] > left:
        raise RequestError(f"{limit_field}={kw['max_new_tokens']} does not fit: the {len(r.prompt_ids)}-token "
                           f"prompt leaves {left} of the {limit} positions", param=limit_field)
    bad = [i for i in stop_ids if not 0 <= i < pipe.cfg.vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {pipe.cfg.vocab_size})")
    own = frozenset() if ignore_eos else r.eos
    r.unshown = r.eos - own  # (as vLLM's detokenizer, which skips special tokens)
    r.eos = frozenset(stop_ids) | own
    r.stop_tokens = r.eos - own  # (EOS first, as vLLM's: a stop token that is EOS too gives no stop_reason)
    r.min_tokens = min_tokens
    return r


def run(pipe, kw, on_text=None):
    """Generate for parsed keywords, alone: (prompt token ids, Result)."""
    r = make(pipe, kw)
    return r.prompt_ids, pipe.run_one(r, on_text)
