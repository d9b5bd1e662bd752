"""Tokenizer for a Hugging Face model directory, without torch or transformers.

tokenizer.json is run by the `tokenizers` package; tokenizer_config.json supplies what transformers
would add on top: BOS/EOS tokens, add_bos_token (else the post-processor's BOS) and the Jinja chat template.
"""
import functools
import hashlib
import json
import os
import re

from .errors import MindspecError, read_json, regular


def _byte_level_alphabet():
    """GPT-2's byte-level BPE spells byte b as this character (tokenizers' ByteLevel): character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(moved)}}


UNBYTE = _byte_level_alphabet()


def _token_str(v):
    """tokenizer_config stores special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _template_file(model_dir):
    """The chat template transformers (since 4.5x) saves in a file of its own, chat_template.jinja; as
    transformers loads it, it wins over tokenizer_config.json's chat_template. None without the file."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if not os.path.exists(path):
        return None
    try:
        with open(regular(path), encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise MindspecError(f"chat_template.jinja is not UTF-8 text: {path}") from None
    except OSError as e:
        raise MindspecError(f"cannot read chat_template.jinja: {path} ({e.strerror})") from None


class Tokenizer:
    def __init__(self, model_dir):
        from tokenizers import Tokenizer as _HFTokenizer, decoders
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise MindspecError(f"tokenizer.json not found: {path}")
        regular(path)
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise MindspecError(f"tokenizer.json is not a valid tokenizer: {path} "
                                f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        # (known now: token_bytes may run as the interpreter shuts down, a stream's requests ending, and an
        # import then raises)
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        cfg = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            try:
                cfg = read_json(cfg_path)
            except (OSError, ValueError) as e:
                raise MindspecError(f"tokenizer_config.json is not valid JSON: {cfg_path} ({e})") from None
            if not isinstance(cfg, dict):
                raise MindspecError(f"tokenizer_config.json is not a JSON object: {cfg_path}")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if "add_bos_token" in cfg:  # LlamaTokenizer's switch (Llama-2 and kin): it decides
            self.prefix = [self.bos_token_id] if cfg["add_bos_token"] and self.bos_token_id is not None else []
        else:  # what tokenizer.json's post-processor puts before a text, as transformers runs it (Llama-3)
            self.prefix = self._post_processor_prefix()
        self.chat_template = _template_file(model_dir) or cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # transformers' named-template form
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default")
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = set() if eos is None else {eos}

    def _post_processor_prefix(self):
        """The special tokens the post-processor puts before a text (tokens it appends are not a prompt's)."""
        bare, full = (self._tok.encode("a", add_special_tokens=flag).ids for flag in (False, True))
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        return full[:at]

    @property
    def vocab_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def highest(self):
        """(id, token) of the vocabulary's highest id (ids need not be dense: a count says nothing of it)."""
        return max(((i, t) for t, i in self._tok.get_vocab(with_added_tokens=True).items()), default=(-1, None))

    @functools.cached_property
    def _longest(self):
        """Characters of the vocabulary's longest token (its stored form: at least its text's length)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def _slack(self):
        """How many times `limit` longest tokens a text may be and still fit: 1 where a token never covers
        more characters than its stored form (byte-level pre-tokenizing, nothing dropped or merged beyond
        it: no normalizer, no special token that swallows whitespace, no fused unknowns), else 4 (a
        normalizer composes 3 code points into 1 at most)."""
        tok = self._tok  # (its parts' own state: the whole tokenizer's JSON would be 100x slower to write)
        pre = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer is not None else {}
        parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        tight = (tok.normalizer is None and any(p.get("type") == "ByteLevel" for p in parts)
                 and not getattr(tok.model, "fuse_unk", False)
                 and not any(a.lstrip or a.rstrip for a in tok.get_added_tokens_decoder().values()))
        return 1 if tight else 4

    def encode(self, text, limit=None, said=None):
        """Ids of `text`; special tokens written in it (e.g. "<|im_start|>") become their ids.
        BOS (self.prefix) is prepended as transformers would, unless the text already starts with it
        (chat templates often write it themselves). limit: a text that cannot fit `limit` tokens whatever
        it says is refused before the tokenizer runs (a 4 MB prompt is seconds of it): more characters than
        `limit` longest tokens hold, times _slack. said: how the refusal names that limit (max_seq LIMIT)."""
        if limit is not None and len(text) > self._slack * limit * self._longest:
            raise MindspecError(f"prompt is {len(text)} characters; it does not fit {said or f'max_seq {limit}'}")
        # (encode_batch lets go of the GIL while it works, encode does not: a server's long prompt, tokenized on
        # a worker thread, stalled the engine's thread for seconds all the same)
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        p = self.prefix
        return ids if ids[:len(p)] == p else p + ids

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def pieces(self, ids):
        """The vocabulary's strings of ids (transformers' convert_ids_to_tokens: byte-level pieces as stored)."""
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token):
        return self._tok.token_to_id(token)

    def token_bytes(self, i):
        """The UTF-8 bytes token i stands for. decode([i]) gives U+FFFD for a token ending inside a
        character, and drops a SentencePiece word's leading space; its bytes come from its spelling:
        byte-level BPE's alphabet, a <0xNN> byte-fallback piece, "▁" for a space."""
        text, piece = self.decode([i]), self._tok.id_to_token(int(i))
        if piece is not None and piece.startswith("▁") and not text.startswith(" "):
            return (" " + text).encode("utf-8")
        if piece is None or "\ufffd" not in text:
            return text.encode("utf-8")
        if (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if self._byte_level and all(c in UNBYTE for c in piece):
            return bytes(UNBYTE[c] for c in piece)
        return text.encode("utf-8")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        """Render chat messages to a prompt string, the way transformers does."""
        if not self.chat_template:
            raise MindspecError("this tokenizer has no chat_template (chat_template.jinja or tokenizer_config.json); "
                                "pass a plain prompt instead")
        from jinja2 import TemplateError
        try:
            template = _jinja_env().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except Exception as e:  # noqa: BLE001 - the template is the model's code: Jinja's errors, or a TypeError
            why = e if isinstance(e, TemplateError) else f"{type(e).__name__}: {e}"
            raise MindspecError(f"chat template failed: {why}") from None

    def vocab_fingerprint(self):
        """Identity of the token -> id map: a draft must share it with its target."""
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: (kv[1], kv[0]))
        blob = json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]


def _raise_exception(message):
    from jinja2 import TemplateError
    raise TemplateError(message)


def _jinja_env():
    # Same settings as transformers, so templates written for it render identically.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    return env


class StreamDecoder:
    """Turns ids arriving a few at a time into text, never emitting half a UTF-8 character.

    Decodes a small window (the previously emitted tokens + the new ones) and emits the difference,
    so cost per push stays constant and tokenizers that drop a leading space at the start of a
    decode (SentencePiece) still join correctly.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids = []
        self._prefix = 0  # start of the decode window
        self._read = 0    # ids before this are already emitted

    def push(self, ids):
        self.ids.extend(int(i) for i in ids)
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
        text = self.tok.decode(self.ids[self._prefix:])
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for more bytes.
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text):]

    def flush(self):
        """The text held back, at the end of a generation: a character cut short (its first bytes) is
        dropped, as vLLM and TGI do (U+FFFD cannot be undone by a client that sends the text back)."""
        if self._read == len(self.ids):
            return ""
        held = self.ids[self._read:]
        parts = [self.tok.token_bytes(i) for i in held]
        sizes, tail = [len(p) for p in parts], _unfinished(b"".join(parts))
        while tail and held and 0 < sizes[-1] <= tail:  # tokens that hold nothing but the cut character's bytes
            tail -= sizes.pop()
            held.pop()
        prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
        text = self.tok.decode(self.ids[self._prefix:self._read] + held)
        if tail and text.endswith("\ufffd"):  # the rest of it shares a token with text before it (byte-level BPE)
            text = text[:-1]
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]


def _unfinished(data):
    """How many bytes at the end of data start a UTF-8 character they do not finish (0: none)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return len(data) - e.start if e.reason == "unexpected end of data" else 0
    return 0

