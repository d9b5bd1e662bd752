"""Tokenizer wrapper and streaming detokenization on the tiny byte-level tokenizer from conftest."""
import json
import random

import pytest

from conftest import CHAT_TEMPLATE, write_tiny_tokenizer
from mindspec.errors import MindspecError
from mindspec.formats import pieces
from mindspec.tokenizer import StreamDecoder, Tokenizer

TEXT = "héllo 世界 🦙!"


@pytest.fixture()
def tok_dir(tmp_path):
    write_tiny_tokenizer(tmp_path)
    return tmp_path


def test_byte_tokens_round_trip(tok_dir):
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8"))  # no merges: one token per byte
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size == 3 + 256 and tok.eos_token_ids == {2} and tok.bos_token_id is None


def test_token_bytes_are_what_each_token_stands_for(tok_dir):
    """A token ending inside a character decodes alone to U+FFFD; OpenAI's logprobs give each token's
    bytes so that a client can rebuild such characters (found: the bytes of U+FFFD were given)."""
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode(TEXT)
    assert "\ufffd" in tok.decode([ids[1]]) and b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert tok.token_bytes(2) == b"<|im_end|>"  # a special token: its text


def _byte_fallback_tokenizer(path):
    """SentencePiece's byte fallback (Llama-2's tokenizer.json): a character outside the vocabulary is
    pieces <0xE4><0xB8><0x96>, each decoding alone to U+FFFD."""
    from tokenizers import Tokenizer as HF, decoders, models, normalizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁hi": 259}
    t = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.save(str(path / "tokenizer.json"))
    return Tokenizer(str(path))


def test_token_bytes_of_byte_fallback_pieces(tmp_path):
    tok = _byte_fallback_tokenizer(tmp_path)
    ids = tok.encode("世")[-3:]
    assert [tok.decode([i]) for i in ids] == ["\ufffd"] * 3
    assert b"".join(tok.token_bytes(i) for i in ids) == "世".encode()
    assert tok.decode([259]) == "hi" and tok.token_bytes(259) == b" hi"  # "▁hi": a word's space is its first byte


def test_token_bytes_of_a_word_whose_decoder_keeps_its_space(tmp_path):
    """A SentencePiece decoder without Strip (some Llama-2 kin) decodes "▁hi" alone to " hi" already: its
    bytes are those, not a second space before them."""
    from tokenizers import Tokenizer as HF, decoders
    _byte_fallback_tokenizer(tmp_path)
    raw = HF.from_file(str(tmp_path / "tokenizer.json"))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(str(tmp_path))
    assert tok.decode([259]) == " hi" and tok.token_bytes(259) == b" hi"


def test_encoding_lets_other_threads_run(tok_dir):
    """Found by a review: the server tokenizes prompts on a worker thread so that the engine's thread goes
    on stepping, but the tokenizer's encode held the GIL for the whole of a long prompt (seconds: no other
    thread ran). A thread that wakes every millisecond now runs while a long text is encoded."""
    import threading
    import time
    tok, text, beats, stop = Tokenizer(str(tok_dir)), "hello world " * 60000, [], threading.Event()

    def beat():
        while not stop.is_set():
            beats.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=beat)
    t.start()
    try:
        t0 = time.perf_counter()
        ids = tok.encode(text)
        t1 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    assert ids[len(tok.prefix):] == tok._tok.encode(text, add_special_tokens=False).ids  # (the same ids)
    assert t1 - t0 > 0.2, "too short a text to tell"  # (the beats inside, away from its ends, tell)
    assert len([b for b in beats if t0 + 0.05 < b < t1 - 0.05]) >= 5, (t1 - t0, len(beats))


def test_special_tokens(tok_dir):
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 2 + len("user\nhi")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>"


def test_stream_decoder_never_splits_a_character(tok_dir):
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode(TEXT)
    sd = StreamDecoder(tok)
    pieces = [sd.push([i]) for i in ids] + [sd.flush()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["h", "", "é"]  # é is two bytes: nothing until the second arrives


@pytest.mark.parametrize("seed", range(5))
def test_stream_decoder_random_chunks_equal_decode(tok_dir, seed):
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode("<|im_start|>" + TEXT * 3 + "<|im_end|>")
    rng = random.Random(seed)
    sd, out, i = StreamDecoder(tok), [], 0
    while i < len(ids):
        n = rng.randint(0, 4)
        out.append(sd.push(ids[i:i + n]))
        i += n
    assert "".join(out) + sd.flush() == tok.decode(ids)


def _texts(req):
    """Each token's text as the server's streams and non-streamed answers give it."""
    return [t for _, t, _ in pieces(req, 0, len(req.text), final=True)]


def test_token_texts_give_a_character_to_the_token_that_completes_it(tok_dir):
    """TGI's details.tokens[].text and completions' text_offset: found each token decoded alone (U+FFFD for
    a character's first bytes), so they did not add up to the text, nor count as the stream did. They are the
    request's own pieces: an EOS that min_tokens kept has none, a stop string is cut."""
    from mindspec.sampling import SamplingParams
    from mindspec.sequence import Request
    tok = Tokenizer(str(tok_dir))
    r = Request([5], SamplingParams(temperature=0.0), 99, eos=[2], tokenizer=tok)
    r.commit(tok.encode(TEXT))
    r.finish("length")
    assert _texts(r)[:3] == ["h", "", "é"] and "".join(_texts(r)) == TEXT
    r = Request([5], SamplingParams(temperature=0.0), 99, eos=[2], tokenizer=tok)
    r.min_tokens = 3
    r.commit(tok.encode("a") + [2] + tok.encode("原b") + [2])
    assert r.text == "a原b" and _texts(r) == ["a", "", "", "", "原", "b", ""]
    r = Request([5], SamplingParams(temperature=0.0), 99, stop=["c"], tokenizer=tok)
    r.commit(tok.encode("abcd"))
    assert r.text == "ab" and _texts(r) == ["a", "b", ""]


@pytest.mark.parametrize("end", ["length", "eos", "abort"])
def test_a_stop_string_in_the_text_a_request_ends_with_is_cut(tok_dir, end):
    """Found (a Chinese prompt, greedy): the text held back behind a character's first bytes is released
    when the request ends, and that release was never searched for stop strings: "\n\n# \ufffd" with
    finish_reason length for stop=["# "], the stop string streamed too."""
    from mindspec.sampling import SamplingParams
    from mindspec.sequence import Request
    write_tiny_tokenizer(tok_dir, merges=[("Ġ", "å")])  # a token of a space and 原's first byte, as SmolLM2's
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode("\n\n# 原")[:-2]  # ..., "#", " \xe5"
    assert tok.decode(ids[-1:]) == " \ufffd"
    r = Request([5], SamplingParams(temperature=0.0), len(ids) + (end != "length"), stop=["# "], eos=[2],
                tokenizer=tok)
    shown = r.commit(ids)
    assert r.done == (end == "length") and "#" not in shown
    shown += r.commit([2]) if end == "eos" else r.finish("abort") if end == "abort" else ""
    assert r.done and r.text == "\n\n" and shown == "\n\n"
    assert r.finish_reason == {"length": "stop", "eos": "stop", "abort": "abort"}[end]


def test_a_request_cut_inside_a_character_drops_its_first_bytes(tok_dir, tmp_path):
    """max_new_tokens ending inside a character: the text ended with U+FFFD, which a client that sends the
    answer back cannot undo; as vLLM, the unfinished character is dropped (its ids stay in token_ids). A
    byte that can start no character stays U+FFFD."""
    from mindspec.sampling import SamplingParams
    from mindspec.sequence import Request
    tok = Tokenizer(str(tok_dir))
    lone = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\x80")  # a continuation byte alone
    for ids, want in ((tok.encode("中文")[:-1], "中"), (tok.encode("a") + [lone], "a\ufffd")):
        r = Request([5], SamplingParams(temperature=0.0), len(ids), tokenizer=tok)
        assert r.commit(ids) == want and r.text == want and r.finish_reason == "length"
        assert "".join(_texts(r)) == want
    # byte fallback: each byte of a character cut short was a U+FFFD of its own (found: one dropped of two)
    tok = _byte_fallback_tokenizer(tmp_path)
    want = tok.decode(tok.encode("hi 世"))  # (this vocabulary spells even "▁" in bytes)
    for cut in (1, 2):
        ids = tok.encode("hi 世界")[:-cut]
        r = Request([5], SamplingParams(temperature=0.0), len(ids), tokenizer=tok)
        assert r.commit(ids) == want and r.text == want and want.endswith("世")


def test_a_stop_string_within_min_tokens_is_not_cut_at_the_end(tok_dir):
    """min_tokens: stop strings ending within the first min_tokens tokens are not stops (vLLM's), also in
    the text released at the end (found: cut there, and kept when the same text came out earlier)."""
    from mindspec.sampling import SamplingParams
    from mindspec.sequence import Request
    write_tiny_tokenizer(tok_dir, merges=[("Ġ", "å")])
    tok = Tokenizer(str(tok_dir))
    for text in ("# 原", "# x"):
        ids = tok.encode(text)[:2]  # "#", " \xe5" or "#", " "
        r = Request([5], SamplingParams(temperature=0.0), 9, stop=["# "], eos=[2], tokenizer=tok)
        r.min_tokens = 2
        r.commit(ids + [2])
        assert r.text == "# " and r.finish_reason == "stop", text


def test_stream_decoder_flushes_incomplete_tail(tok_dir):
    tok = Tokenizer(str(tok_dir))
    ids = tok.encode("a世")[:-1]  # "a" + two of the three bytes of 世
    sd = StreamDecoder(tok)
    assert sd.push(ids[:1]) == "a"
    assert sd.push(ids[1:]) == ""  # held back: the text ends with U+FFFD
    assert sd.flush() == ""  # a generation cut mid-character: the unfinished character is dropped, as vLLM's
    assert sd.flush() == ""


def test_chat_template(tok_dir):
    tok = Tokenizer(str(tok_dir))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_template_errors(tok_dir):
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{{ raise_exception('only user turns') }}"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(MindspecError, match="only user turns"):
        Tokenizer(str(tok_dir)).apply_chat_template([{"role": "system", "content": "x"}])
    cfg["chat_template"] = "{{ messages[0]['content'] + 1 }}"  # a TypeError inside the template: was a traceback
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(MindspecError, match="chat template failed: .*str"):
        Tokenizer(str(tok_dir)).apply_chat_template([{"role": "user", "content": "x"}])
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(MindspecError, match="chat_template"):
        Tokenizer(str(tok_dir)).apply_chat_template([{"role": "user", "content": "x"}])


def test_named_chat_templates_render_the_default_one(tok_dir):
    """transformers' named-template form (a list of {"name", "template"}: tool_use or rag templates
    beside default): the one named "default" is the chat template."""
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": [{"name": "tool_use", "template": "TOOL"},
                                                     {"name": "default", "template": CHAT_TEMPLATE}]}))
    tok = Tokenizer(str(tok_dir))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_chat_template_in_its_own_file_is_the_chat_template(tok_dir):
    """transformers (since 4.5x) saves a tokenizer's chat template as chat_template.jinja, not in
    tokenizer_config.json: such a model had "no chat_template" (found reading the format). As transformers
    loads it, the file wins over the key."""
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    (tok_dir / "chat_template.jinja").write_text(cfg.pop("chat_template"), encoding="utf-8")
    cfg_path.write_text(json.dumps(cfg))
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert Tokenizer(str(tok_dir)).apply_chat_template([{"role": "user", "content": "hi"}]) == want
    cfg_path.write_text(json.dumps(dict(cfg, chat_template="OLD")))
    assert Tokenizer(str(tok_dir)).apply_chat_template([{"role": "user", "content": "hi"}]) == want
    (tok_dir / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(MindspecError, match="chat_template.jinja is not UTF-8 text"):
        Tokenizer(str(tok_dir))


def test_chat_template_environment_is_transformers(tok_dir):
    """As transformers renders a template: bos_token and eos_token given, trim_blocks (the newline after a
    block tag dropped) and a tojson that keeps non-ASCII characters as they are."""
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": "{{ bos_token }}{% for m in messages %}\n{{ m['content'] | tojson }}{{ eos_token }}"
                         "{% endfor %}"}))
    tok = Tokenizer(str(tok_dir))
    assert tok.apply_chat_template([{"role": "user", "content": "héllo"}]) == '<|endoftext|>"héllo"<|im_end|>'


def test_add_bos_token(tok_dir):
    cfg_path = tok_dir / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|im_end|>",
                                    "add_bos_token": True, "chat_template": CHAT_TEMPLATE}))
    tok = Tokenizer(str(tok_dir))
    assert tok.encode("a") == [0, tok.encode("a")[1]]
    assert tok.encode("<|endoftext|>a")[:2] != [0, 0]  # already there: not doubled


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_bos_as_transformers_adds_it(tok_dir, add_bos):
    """A prompt starts with BOS where transformers would put one: tokenizer_config's add_bos_token when it
    has the key (LlamaTokenizer's switch), else the special tokens tokenizer.json's post-processor puts
    before a text (Llama-3: PreTrainedTokenizerFast, no add_bos_token; found: its plain prompts ran
    without <|begin_of_text|>). A text that starts with them already (a chat template's) gets no second."""
    from tokenizers import Tokenizer as Raw, processors
    raw = Raw.from_file(str(tok_dir / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    raw.save(str(tok_dir / "tokenizer.json"))
    cfg = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(str(tok_dir))
    a = raw.encode("a", add_special_tokens=False).ids
    assert tok.encode("a") == ([] if add_bos is False else [0]) + a
    assert tok.encode("<|endoftext|>a") == [0] + a  # not doubled


def test_vocab_fingerprint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_tiny_tokenizer(a)
    write_tiny_tokenizer(b)
    assert Tokenizer(str(a)).vocab_fingerprint() == Tokenizer(str(b)).vocab_fingerprint()
    raw = json.loads((b / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[3:5]  # swap the ids of two byte tokens
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (b / "tokenizer.json").write_text(json.dumps(raw))
    assert Tokenizer(str(a)).vocab_fingerprint() != Tokenizer(str(b)).vocab_fingerprint()


@pytest.mark.parametrize("broken, name", [("missing", "tokenizer.json"), ("garbled", "tokenizer.json"),
                                          ("garbled_config", "tokenizer_config.json"),
                                          ("list_config", "tokenizer_config.json")])
def test_bad_files(tok_dir, broken, name):
    if broken == "missing":
        (tok_dir / "tokenizer.json").unlink()
    elif broken == "garbled":
        (tok_dir / "tokenizer.json").write_text("{not json")
    elif broken == "garbled_config":
        (tok_dir / "tokenizer_config.json").write_text("[1, 2")
    else:  # JSON, but not an object: was an AttributeError traceback
        (tok_dir / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(MindspecError) as e:
        Tokenizer(str(tok_dir))
    assert name in str(e.value) and "\n" not in str(e.value)
    exact = {"missing": f"tokenizer.json not found: {tok_dir / 'tokenizer.json'}",
             "list_config": f"tokenizer_config.json is not a JSON object: {tok_dir / 'tokenizer_config.json'}"}
    if broken in exact:
        assert str(e.value) == exact[broken]


def test_config_is_optional(tok_dir):
    (tok_dir / "tokenizer_config.json").unlink()
    tok = Tokenizer(str(tok_dir))
    assert tok.eos_token_ids == set() and tok.decode(tok.encode(TEXT)) == TEXT


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(tok_dir):
    """Found trying the server as an attacker: a prompt just under the old bound (4 x limit x the longest
    token, 166k characters at max_seq 512) cost the engine 0.3 s of tokenizing (441k tokens of random CJK)
    before its refusal. Byte-level, with nothing that lets a token cover more than its stored form, the
    bound is limit x the longest token; a normalizer's compositions or a special token that swallows the
    whitespace beside it keep the 4x allowance (a text that fits is never refused)."""
    from tokenizers import AddedToken, normalizers
    tok = Tokenizer(str(tok_dir))
    longest = max(map(len, tok._tok.get_vocab(with_added_tokens=True)))
    assert len(tok.encode("a" * 10 * longest, limit=10)) == 10 * longest  # (as many tokens as characters here)
    with pytest.raises(MindspecError, match=f"prompt is {10 * longest + 1} characters; it does not fit max_seq 10"):
        tok.encode("a" * (10 * longest + 1), limit=10)
    for change in (lambda t: setattr(t, "normalizer", normalizers.NFC()),  # three code points may compose
                   lambda t: t.add_special_tokens([AddedToken("<|sep|>", rstrip=True)]),  # eats what follows
                   lambda t: t.add_special_tokens([AddedToken("<|sep|>", lstrip=True)]),  # eats what precedes
                   lambda t: setattr(t.model, "fuse_unk", True)):  # a run of unknowns is one token
        write_tiny_tokenizer(tok_dir)
        raw = Tokenizer(str(tok_dir))._tok
        change(raw)
        raw.save(str(tok_dir / "tokenizer.json"))
        tok = Tokenizer(str(tok_dir))
        long = max(map(len, tok._tok.get_vocab(with_added_tokens=True)))
        assert len(tok.encode("a" * (10 * long + 1), limit=10)) == 10 * long + 1
        with pytest.raises(MindspecError, match="does not fit max_seq 10"):
            tok.encode("a" * (40 * long + 1), limit=10)


def test_a_sequence_pre_tokenizer_is_byte_level_too(tok_dir):
    """Qwen2's and Llama-3's pre-tokenizer is a Sequence: a regex Split, then ByteLevel without its own regex.
    The ByteLevel inside it counts: a text that cannot fit is refused at once (the tight bound)."""
    from tokenizers import Regex, pre_tokenizers as pt
    raw = Tokenizer(str(tok_dir))._tok
    raw.pre_tokenizer = pt.Sequence([pt.Split(Regex(r"\s+"), "isolated"),
                                     pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    raw.save(str(tok_dir / "tokenizer.json"))
    tok = Tokenizer(str(tok_dir))
    longest = max(map(len, tok._tok.get_vocab(with_added_tokens=True)))
    assert len(tok.encode("a" * 10 * longest, limit=10)) == 10 * longest
    with pytest.raises(MindspecError, match=f"^prompt is {10 * longest + 1} characters; it does not fit max_seq 10$"):
        tok.encode("a" * (10 * longest + 1), limit=10)
