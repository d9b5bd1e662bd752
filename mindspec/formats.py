"""Response bodies and stream events of `mindspec serve`'s APIs: OpenAI (as MindIE's vLLM-style
interface) and TGI 0.9.4 / MindIE's native /infer. A formatter turns the engine's output of one
request into its API's JSON: `chunk(delta, tokens)` per step, `last(done)` at the end of a choice's
stream, `response(done)` for a non-streamed answer (done: each choice's (prompt ids, Result, tokens not
streamed, every token), None for a choice still running). `tokens` are (id, text, logprob)
triples whose texts concatenate to the generated text (logprob: the request's entry for that token,
(logprob, [(id, logprob)] of its best alternatives), None when it asked none)."""
import time
import uuid


def openai_error(status, message, param=None):
    """OpenAI's error body (also the shape of the errors that are no API's own: transport, routing)."""
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": " ".join(str(message).split()), "type": kind, "param": param, "code": status}}


def tgi_error(status, message):
    """TGI's and MindIE's error body."""
    kind = "overloaded" if status in (429, 503) else "validation" if status < 500 else "generation"  # (TGI's 429)
    return {"error": " ".join(str(message).split()), "error_type": kind}


def pieces(req, sent, shown, final):
    """(id, text, logprob) of req's tokens from index `sent` whose text is all out: their text ends within the
    first `shown` characters streamed, and a later token has text (the bytes of a character cut short
    may still come to it at the end). When final, every remaining token; the last takes what is left."""
    text, out, ends = req.text, [], req.ends
    n = len(req.output) if final else sent + sum(1 for e in ends[sent:] if e <= shown)
    while not final and n > sent and ends[n - 1] == (ends[n - 2] if n > 1 else 0):
        n -= 1  # a last token without text of its own waits: the rest of its character may come at the end
    for i in range(sent, n):
        start, end = (min(req.ends[i - 1], len(text)) if i else 0), min(req.ends[i], len(text))
        lp = req.token_logprobs[i] if req.logprobs is not None else None
        out.append((req.output[i], text[start:] if final and i == n - 1 else text[start:end], lp))
    return out


def _lp_entry(pipe, i, lp):
    """(bytes: the token's own, a character's first bytes included, as OpenAI gives them to rebuild it)"""
    return {"token": pipe.tokenizer.decode([i]), "logprob": lp, "bytes": list(pipe.tokenizer.token_bytes(i))}


def chat_logprobs(pipe, tokens):
    """OpenAI chat's choice.logprobs of (id, text, logprob) triples (None when none was asked)."""
    if not tokens or tokens[0][2] is None:
        return None
    return {"content": [dict(_lp_entry(pipe, i, lp), top_logprobs=[_lp_entry(pipe, j, x) for j, x in top])
                        for i, _, (lp, top) in tokens]}


def completion_logprobs(pipe, tokens, offset=0):
    """OpenAI completions' choice.logprobs (tokens, token_logprobs, top_logprobs, text_offset) of
    (id, text, logprob) triples, the first one `offset` characters into the text."""
    if not tokens or tokens[0][2] is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, text, (lp, top) in tokens:
        out["tokens"].append(pipe.tokenizer.decode([i]))
        out["token_logprobs"].append(lp)
        # the token's own entry first: OpenAI's "up to logprobs+1 elements", as vLLM's (whose top entries win
        # a text two ids decode to)
        out["top_logprobs"].append({out["tokens"][-1]: lp, **{pipe.tokenizer.decode([j]): x for j, x in top}})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def token(pipe, i, text=None):
    """TGI's token object (special: EOS, or a token that decodes to nothing without specials)."""
    full = pipe.tokenizer.decode([i])
    special = i in pipe.eos or (full != "" and pipe.tokenizer.decode([i], skip_special_tokens=True) == "")
    return {"id": i, "text": full if text is None else text, "logprob": None, "special": special}


class OpenAI:
    """/v1/completions and /v1/chat/completions bodies and SSE chunks (usage in the final chunk, then
    `data: [DONE]`; with n > 1, in the last choice's final chunk: one usage, as the non-streamed answer's).
    A choice's stop_reason is vLLM's: the stop string or stop token id that ended it, None for EOS or length."""
    family, done_marker = "openai", True

    def __init__(self, app, chat, index=0, head=None, include_usage=None):
        """index: the choice this formats (OpenAI's n); head: the response's id and times, shared by its choices;
        include_usage: stream_options' (None: usage in the final chunk, MindIE's way; True: OpenAI's, in a chunk of
        its own with no choices after the last choice's, every other chunk's usage null; False: no usage)."""
        self.app, self.chat, self.index, self.sent_role = app, chat, index, False
        self.include_usage = include_usage
        self.offset = 0  # characters streamed so far (completions' text_offset)
        self.head = head or {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                             "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": app.model_name}

    def _choice(self, text, finish, delta=False, index=None, tokens=None, stop=None):
        """tokens: the (id, text, logprob) triples this choice or chunk carries (for its logprobs); stop: its
        stop_reason."""
        i = self.index if index is None else index
        if not self.chat:
            lp = completion_logprobs(self.app.pipe, tokens, self.offset)
            self.offset += sum(len(t) for _, t, _ in tokens or ())
            return {"index": i, "text": text, "logprobs": lp, "stop_reason": stop, "finish_reason": finish}
        msg = {"content": text} if text is not None else {}
        if not delta:
            msg["role"] = "assistant"
        return {"index": i, "delta" if delta else "message": msg, "logprobs": chat_logprobs(self.app.pipe, tokens),
                "finish_reason": finish, "stop_reason": stop}

    def _stream_head(self):
        return dict(self.head, object="chat.completion.chunk") if self.chat else self.head

    def _chunk(self, choices, **fields):
        """A stream chunk (with include_usage, its usage null unless fields give it)."""
        usage = {"usage": None} if self.include_usage else {}
        return dict(self._stream_head(), choices=choices, **(usage | fields))

    def _tail(self, done):
        """usage (the prompt once, every choice's tokens) and "mindspec" (a list of each one's stats when n > 1)."""
        ids, results = done[0][0], [res for _, res, _, _ in done]
        n = sum(len(r.token_ids) for r in results)
        usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
                 "prompt_tokens_details": {"cached_tokens": results[0].stats.get("cached_tokens", 0)}}
        return {"usage": usage, "mindspec": [r.stats for r in results] if len(results) > 1 else results[0].stats}

    def response(self, done):
        """done: (prompt ids, Result, tokens not streamed, every token) of each choice (tokens: the
        streams' (id, text, logprob), so text_offset counts the same streamed or not)."""
        choices = []
        for i, (_, r, _, every) in enumerate(done):
            self.offset = 0
            choices.append(self._choice(r.text, r.finish_reason, index=i, tokens=every, stop=r.stop_reason))
        return dict(self.head, choices=choices, **self._tail(done))

    def _role(self):
        """The chat stream's first chunk, once (also when no text comes at all)."""
        if not self.chat or self.sent_role:
            return []
        self.sent_role = True
        return [self._chunk([dict(self._choice("", None, True), delta={"role": "assistant", "content": ""})])]

    def chunk(self, delta, tokens):
        return self._role() + [self._chunk([self._choice(delta, None, True, tokens=tokens)])]

    def last(self, done):
        """This choice's final chunk; the last choice's carries the stats and usage of them all (found: each
        its own), the usage as include_usage says."""
        _, res, tokens, _ = done[self.index]
        choice = self._choice(None if self.chat else "", res.finish_reason, True, tokens=tokens, stop=res.stop_reason)
        tail = self._tail(done) if None not in done else {}
        usage = tail.pop("usage", None) if self.include_usage is not None else None
        own = [self._chunk([], usage=usage)] if usage and self.include_usage else []  # (after every choice's)
        return self._role() + [self._chunk([choice], **tail)] + own


class TGI:
    """TGI 0.9.4 /generate (+ details) and /generate_stream events, and MindIE's native /infer
    (details: finish_reason, generated_tokens, seed; stream events with prefill_time/decode_time in
    ms). A stream event per token, with its id and text; streams end without [DONE], as TGI's do."""
    family, done_marker = "tgi", False

    def __init__(self, app, kw, native, details, decoder_input_details=False, full_text_prefix="", listed=False):
        self.app, self.kw, self.native, self.details, self.listed = app, kw, native, details, listed
        self.decoder_input_details, self.prefix = decoder_input_details, full_text_prefix
        self.pending, self.t0, self.first = None, time.perf_counter(), True

    def _finish(self, res):
        if res.finish_reason == "length":
            return "length"
        return "eos_token" if res.token_ids and res.token_ids[-1] in self.app.pipe.eos else "stop_sequence"

    def _details(self, ids, res, every=None):
        """every: each token's (id, text, logprob) as the stream gives it (the full details), or None."""
        d = {"finish_reason": self._finish(res), "generated_tokens": len(res.token_ids), "seed": self.kw.get("seed"),
             "prompt_tokens": len(ids)}  # (MindIE's, also in a stream's and /infer's)
        if every is not None:
            pipe = self.app.pipe
            prefill = [token(pipe, i) for i in ids] if self.decoder_input_details else []
            d.update(prefill=prefill, tokens=[self._token(i, t, lp) for i, t, lp in every])
            if self.kw.get("logprobs"):  # top_n_tokens
                d["top_tokens"] = [self._top(lp) for _, _, lp in every]
        return d

    def _token(self, i, text, lp):
        """TGI's token object, its logprob (None unless top_n_tokens asked for them) filled in."""
        return dict(token(self.app.pipe, i, text), logprob=None if lp is None else lp[0])

    def _top(self, lp):
        """top_n_tokens' alternatives of a token: TGI's token objects, likeliest first."""
        return [] if lp is None else [dict(token(self.app.pipe, j), logprob=x) for j, x in lp[1]]

    def response(self, done):
        ids, res, _, every = done[0]
        out = {"generated_text": self.prefix + res.text}
        if self.details:
            out["details"] = self._details(ids, res, None if self.native else every)
        out["mindspec"] = res.stats
        return [out] if self.listed else out  # TGI's POST / answers a list of one

    def _event(self, pending):
        (i, text, lp), prefill_ms, decode_ms = pending
        if self.native:
            return {"prefill_time": prefill_ms, "decode_time": decode_ms, "token": {"id": i, "text": text}}
        top = {"top_tokens": self._top(lp)} if self.kw.get("logprobs") else {}
        return {"token": self._token(i, text, lp), **top, "generated_text": None, "details": None}

    def _timed(self, tokens):
        """(token, prefill_time, decode_time) of each token: ms from the request to its first step, then
        from step to step (a step's later tokens: 0)."""
        now = time.perf_counter()
        ms, self.t0 = round((now - self.t0) * 1000, 2), now
        out = []
        for j, t in enumerate(tokens):
            first, self.first = self.first, False
            step_ms = ms if j == 0 else 0.0
            out.append((t, step_ms if first else None, None if first else step_ms))
        return out

    def chunk(self, delta, tokens):
        """Hold the last token back, so the last event carries a token and the final fields together."""
        timed = ([self.pending] if self.pending else []) + self._timed(tokens)
        if not timed:
            return []
        self.pending = timed[-1]
        return [self._event(t) for t in timed[:-1]]

    def last(self, done):
        ids, res, tokens, _ = done[0]
        timed = ([self.pending] if self.pending else []) + self._timed(tokens)
        if not timed:  # nothing generated at all (cannot happen: a request makes >= 1 token)
            timed = self._timed([(0, "", None)])
        evs = [self._event(t) for t in timed]
        evs[-1]["generated_text"] = self.prefix + res.text
        evs[-1]["details"] = self._details(ids, res) if self.details else None
        evs[-1]["mindspec"] = res.stats
        return evs
