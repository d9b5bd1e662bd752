"""`mindspec` command line: export, convert, generate, serve, batch (+ plan, bench). Bad input: one line
on stderr, exit 2."""
import argparse
import json
import os
import re
import signal
import sys

from .errors import MindspecError
from .request import SEED_ENV, stop_strings
from .device import CHOICES, DEVICE_ENV, check_device_env, check_tp, detect_device
from .spec import DTYPES, K_BUCKETS, SpecConfig
from .mindie_config import QUEUE_DELAY_US, STEP_TIMEOUT
from . import signals, stdout
from .omdir import OmDir
from .signals import Signals

MODEL_COMMANDS = ("generate", "serve", "batch")  # the ones that load a model (and may run on msrun ranks)
HELD = ("generate", "bench", "doctor")  # the ones importing MindSpore that hold no signal handling of their own
SERVE_MAX_SEQ = 1024  # positions per request a server holds by default (--max-seq)
MAX_BATCH = 8  # rows per step of serve and batch: on 2 CPU cores 8 rows cost ~1.8x one (docs/design.md)


def _ids(text):
    """Token ids separated by commas and/or spaces ("1,2,3", "1, 2, 3", "1 2 3"), in decimal digits: an empty item
    ("1,,2", ",1") or another spelling int() reads ("1_0" is 10) is refused (a user probe's: they ran)."""
    items = re.split(r"\s*,\s*|\s+", text.strip())
    if not all(re.fullmatch(r"-?[0-9]+", x) for x in items):
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token ids: {text!r}")
    return [int(x) for x in items]


def _k(text):
    """-k's value, checked while parsing (a server's was refused after it bound its port, a newcomer's)."""
    if text == "auto":
        return text
    try:
        return SpecConfig.check_k(int(text), K_BUCKETS)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or auto: {text!r}") from None
    except MindspecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_export(a):
    from mindspec.export import export_draft
    try:
        m = export_draft(a.model, a.out, quantize=None if a.quantize == "none" else a.quantize, layers=a.layers,
                         max_seq=a.max_seq, dtype=a.dtype, profile=a.profile)
    except MindspecError as e:  # the library's words name its keywords; this user typed the flags
        word = str(e).split(" ", 1)[0]
        if word in ("layers", "max_seq"):
            raise MindspecError("--" + word.replace("_", "-") + str(e)[len(word):]) from None
        raise
    layers = f"{m['num_layers']} layer{'s' * (m['num_layers'] != 1)}"
    print(f"wrote {a.out} ({layers}, {m['dtype']}, quantize={m['quantize'] or 'none'}, profile {m['profile']}) "
          f"and {a.out}.json")


def cmd_convert(a):
    from .convert import convert_gguf
    print(f"wrote {convert_gguf(a.gguf, a.out)}")


def _k_used(s):
    """The steps of each K, e.g. "K=8:4 K=2:1" ("-": none)."""
    return " ".join(f"K={k}:{n}" for k, n in s["k_used"].items()) or "-"


def format_stats(s):
    """A readable table of a generation's stats (--stats)."""
    rows = [("new tokens", s["new_tokens"]), ("target calls (incl. prefill)", s["target_calls"]),
            ("drafted / accepted", f"{s['drafted']} / {s['accepted']}"),
            ("acceptance rate", "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.3f}"),
            ("tokens per target call", f"{s['tokens_per_target_call']:.2f}"),
            ("accepted at draft position", " ".join(map(str, s["accepted_at"])) or "-"),
            ("K used (steps)", _k_used(s)),
            ("time: prefill / draft / verify", f"{s['prefill_s']:.3f} / {s['draft_s']:.3f} / {s['verify_s']:.3f} s"),
            ("time: other", f"{s['wall_s'] - s['prefill_s'] - s['draft_s'] - s['verify_s']:.3f} s"),
            ("wall (after compile) / compile", f"{s['wall_s']:.3f} / {s['compile_s']:.3f} s"),
            ("tokens/s", f"{s['tokens_per_s']:.2f}")]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{w}}  {value}" for name, value in rows)


def add_model_args(p, max_seq="sized to the job"):
    """The model flags of generate, serve and batch (read by load_pipeline); max_seq: the default's words."""
    p.add_argument("--target", type=path_arg, default=None, help="target checkpoint dir (default: the embedded model)")
    p.add_argument("--draft", type=path_arg, default=None,
                   help="draft .onnx from `mindspec export` (default: the embedded pair's; none with --target)")
    p.add_argument("-k", type=_k, default="auto",
                   help="draft tokens per target call: a K bucket 1..8, or auto (dynamic K, the default)")
    p.add_argument("--dynamic-k", dest="k", action="store_const", const="auto",
                   help="choose K each step from measured costs and acceptance (the default; same as -k auto)")
    p.add_argument("--max-seq", type=positive_int, default=None,
                   help=f"fix the KV-cache length (default: {max_seq})")
    p.add_argument("--no-speculate", action="store_true", help="target-only decoding (the baseline)")
    p.add_argument("--device", choices=CHOICES, default=None,
                   help="auto (default: Ascend when an NPU is visible, else CPU), cpu or ascend; target and draft")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the target's weights, activations and KV cache (default: float16 on Ascend, float32 on CPU)")
    p.add_argument("--device-mem", default=None,
                   help="memory per device (e.g. 64GB): refuse, before loading weights, what cannot fit")


def int_in(lo, hi=None):
    """An argparse type: an integer in lo..hi (hi None: no upper bound)."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < lo or hi is not None and n > hi:
            raise argparse.ArgumentTypeError(f"must be an integer {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}"
                                             f", got {text!r}")
        return n
    return parse


positive_int = int_in(1)


def non_negative_number(text):
    """An argparse type: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return v


def path_arg(text):
    """An argparse type: a path, never empty (an unset "$DRAFT" was read as "no draft")."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    return text


def add_batch_arg(p):
    p.add_argument("--max-batch", type=positive_int, default=MAX_BATCH,
                   help=f"requests running at once (KV-cache slots); new ones join as rows finish (default {MAX_BATCH})")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt whole (default: a prompt starting with tokens a finished request "
                        "left in a free slot, e.g. a shared system turn, skips them)")


def add_tp_arg(p):
    p.add_argument("--tp", type=positive_int, default=1,
                   help="split the target over N devices (ranks launched with msrun; heads padded as needed)")
    p.add_argument("--nodes", type=positive_int, default=1,
                   help="machines the job spans; each runs the same command with its own --node-rank (default 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this machine's index, 0..nodes-1 (node 0 writes); required with --nodes > 1")
    p.add_argument("--master-addr", default=None, help="node 0's address, reachable from every node (--nodes > 1)")
    p.add_argument("--master-port", type=int, default=None, help="a free port on node 0, the same on every node")


def add_sampling_args(p):
    """The sampling flags (read by sampling_kwargs); for serve and batch they are the defaults of a
    request that does not set them."""
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="HF's: a positive logit of each token the prompt or output holds is divided by it, a "
                        "negative one multiplied (0.01..100; 1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="OpenAI's: subtracted from the logit of each token the output holds (-2..2; 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="OpenAI's: subtracted once for each time the output holds the token (-2..2; 0 = off)")
    p.add_argument("--draft-temperature", type=float, default=None,
                   help="the draft's temperature (e.g. 1.1): changes acceptance, never the output distribution")
    p.add_argument("--draft-min-conf", type=float, default=None,
                   help="stop drafting before a token the draft gives less than this probability (off)")
    p.add_argument("--seed", type=int, default=None, help="seed: same seed + same K schedule = same text (a fixed "
                   "-k: dynamic K's schedule follows the batch and timings)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def load_pipeline(a):
    """The pipeline of the model flags (add_model_args), kept (_LOADED) until main ends the process."""
    from .pipeline import load
    pipe = load(target=a.target, draft=False if a.no_speculate else a.draft, k=a.k, max_seq=a.max_seq,
                device_mem=_device_mem(a), tp=getattr(a, "tp", 1), max_batch=getattr(a, "max_batch", 1),
                dtype=a.dtype, device=a.device, prefix_cache=getattr(a, "prefix_cache", True))
    _LOADED.append(pipe)
    return pipe


_LOADED = []  # freed, MindSpore's graphs go one by one: main exits without that (see its end)


def sampling_kwargs(a):
    """Pipeline.generate keywords of the sampling flags (add_sampling_args); for serve and batch the
    defaults of their requests, whose seed, when neither the request nor --seed gives one, each request
    draws for itself (request.parse)."""
    out = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
               repetition_penalty=a.repetition_penalty, draft_temperature=a.draft_temperature,
               draft_min_conf=a.draft_min_conf, seed=a.seed, stop=a.stop)
    # (only when set: a batch job's id holds these defaults, and the ids of jobs made before they existed stay)
    return out | {k: getattr(a, k) for k in ("presence_penalty", "frequency_penalty") if getattr(a, k)}


def check_sampling_args(a):
    """The sampling flags' ranges, while parsing: a bad default must not reach every request or line."""
    from .sampling import SamplingParams
    SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, repetition_penalty=a.repetition_penalty,
                   draft_temperature=a.draft_temperature, seed=a.seed, presence_penalty=a.presence_penalty,
                   frequency_penalty=a.frequency_penalty)
    if a.draft_min_conf is not None and not 0 < a.draft_min_conf < 1:
        raise MindspecError(f"draft_min_conf must be between 0 and 1, got {a.draft_min_conf}")
    stop_strings(a.stop)


def _seed(a):
    """generate's seed: --seed, else for a sampled run under msrun one drawn from SEED_ENV, the base every
    rank shares (each machine's launcher draws its own; the ranks take rank 0's), so all ranks draw the
    same uniforms."""
    from .request import SEED_ENV, draw_seed
    if a.seed is not None or not getattr(a, "temperature", 0) or SEED_ENV not in os.environ:
        return a.seed
    return draw_seed()


def cmd_generate(a):
    if a.logprobs is not None and not a.json:  # (they were computed and dropped)
        raise MindspecError("--logprobs needs --json (the logprobs are written in its object)")
    if a.chat and a.prompt_ids is not None:
        raise MindspecError("--chat wraps a text prompt in the chat template: it does not apply to --prompt-ids")
    from .request import run
    pipe = load_pipeline(a)
    stream = None if a.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    # the path of a server's request: an explicit --max-new-tokens beyond what fits is refused, not cut
    _, res = run(pipe, dict(sampling_kwargs(a), seed=_seed(a), prompt=a.prompt, prompt_ids=a.prompt_ids, chat=a.chat,
                            logprobs=a.logprobs, limit_field=a.limit_field), stream)
    s = res.stats
    if a.json:
        out = {"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason, "stats": s,
               "device": pipe.device, "dtype": pipe.dtype}  # (what ran: the default depends on the device)
        if res.logprobs is not None:  # as a batch record's
            out["logprobs"] = [[lp, [list(t) for t in top]] for lp, top in res.logprobs]
        print(json.dumps(out))
        return
    print()
    if a.stats:
        print(format_stats(s), file=sys.stderr)
    acc = f"acceptance {s['acceptance_rate']:.2f}, " if s["acceptance_rate"] is not None else ""
    print(f"[{s['new_tokens']} tokens in {s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tok/s; {acc}"
          f"{s['tokens_per_target_call']:.2f} tokens per target call; "
          f"{f'K={pipe.k}' if pipe.draft_path else 'target only'}; K used {_k_used(s)}; {pipe.dtype} on "
          f"{pipe.device}]", file=sys.stderr)


def cmd_serve(a):
    from .serve import App, follow, prepare, serve
    if a.tp > 1:  # rank 0 listens and hands each turn's requests to the other ranks, which follow in lock step
        from .tp import is_rank0
        if not is_rank0():
            app = App(serve_defaults(a), tp=True, max_batch=a.max_batch)
            app.pipe = prepare(load_pipeline(a), a.max_batch, serve_defaults(a))
            return follow(app)
    _check_size(a, *_check_model_paths(a))
    serve(lambda: load_pipeline(a), serve_defaults(a), host=a.host, port=a.port, model_name=a.model_name,
          tp=a.tp > 1, max_batch=a.max_batch, max_queue=a.max_queue, max_connections=a.max_connections,
          api_key=a.api_key, strict_model_name=a.strict_model_name, read_timeout=a.read_timeout,
          queue_delay_us=a.max_queue_delay_us, step_timeout=a.step_timeout, **_planes(a))


def _planes(a):
    """serve's management and metrics planes from a MindIE config's ports (on its managementIpAddress, else
    the main host's)."""
    host = getattr(a, "management_host", None) or a.host
    return {plane: (host, getattr(a, f"{plane}_port")) for plane in ("management", "metrics")
            if getattr(a, f"{plane}_port", None) is not None}


def _check_model_paths(a):
    """A model that is not there or broken (what can be seen without reading every weight: the config, the
    weights' headers, the tokenizer, the draft's manifest and that it pairs with the target), refused before
    a server binds its port (health answers 503 while it loads: not after a "listening" line) or a
    data-parallel launcher starts its replicas. Returns what it read: (the target's config, the draft's manifest),
    None for what it did not."""
    from .checkpoint import Checkpoint
    from .tokenizer import Tokenizer
    from mindspec.export import check_profile
    from mindspec.export.manifest import check_file, read_manifest, read_pair_manifest
    cfg = m = None
    if a.target is not None:
        cfg, tokenizer = Checkpoint(a.target).config, Tokenizer(a.target)
    if a.draft is not None and not a.no_speculate:
        check_file(a.draft)
        m = read_pair_manifest(a.draft, cfg, tokenizer, sha=False) if a.target is not None else \
            read_manifest(a.draft, sha=False)  # (the load reads it whole; the embedded target's pairing too)
        check_profile(m, a.draft, detect_device(a.device))
    return cfg, m


def _check_size(a, cfg, m, replicas=1):
    """A cache that the pair or the host cannot hold, refused before a server binds its port or a data-parallel
    launcher starts its `replicas` (the load checks it again: pipeline.check_size). cfg, m: what
    _check_model_paths read (cfg None: the embedded target, checked once converted, without its draft, which its
    load may export again; m None: no draft given)."""
    from .config import load_config
    from .default import default_target
    from .pipeline import check_size
    from .spec import resolve_dtype
    if cfg is None:
        target = a.target or default_target()
        if not os.path.exists(os.path.join(target, "config.json")):
            return
        cfg = load_config(target)
    draft = a.draft if m else None
    device = detect_device(a.device)
    check_size(cfg, draft, m, a.max_seq, a.max_batch, dtype=resolve_dtype(a.dtype, device), device=device,
               device_mem=_device_mem(a), tp=a.tp, replicas=replicas)
    if m and a.max_seq > m["max_seq"]:
        raise MindspecError(f"--max-seq {a.max_seq} is more than the {m['max_seq']} positions the draft was "
                            "exported for")


def _device_mem(a):
    from .plan import parse_size
    return parse_size(a.device_mem, "--device-mem") if a.device_mem else None


def serve_defaults(a):
    """What a request to the server does not set: the sampling flags, and the server's prompt limit."""
    return dict(sampling_kwargs(a), max_input_tokens=a.max_input_tokens)


def batch_defaults(a):
    """The request defaults of batch's flags: with the target, the job's fingerprint."""
    return dict(sampling_kwargs(a), chat=a.chat)


def batch_dtype(a):
    """The target's dtype a batch job runs in on this device (part of the job's fingerprint)."""
    from .spec import resolve_dtype
    return resolve_dtype(a.dtype, detect_device(a.device))


def batch_job(a):
    """The job id of batch's flags (mindspec.batch.job_id)."""
    from .batch import job_id
    return job_id(batch_defaults(a), a.target, batch_dtype(a))


def cmd_doctor(a):
    from .doctor import run
    return run(a.device)


def cmd_batch(a):
    from .batch import run_batch
    if a.merge:
        from .dp import merge_command
        return merge_command(a.input, a.output, batch_job(a))
    share = None
    if a.tp > 1:  # every rank runs the job in lock step; rank 0 alone reads and writes the output
        from .tp import share
    part = None if a.dp_replica is None else (a.dp_replica, a.dp)  # one data-parallel replica: its share
    if part is None:
        from .dp import check_parts
        check_parts(a.output, 1)  # a --dp run's unmerged parts: its lines would run twice
    return run_batch(lambda: load_pipeline(a), batch_defaults(a), a.input, a.output,
                     share=share, model=a.target, max_batch=a.max_batch, part=part,
                     dtype=batch_dtype(a))


def launch_dp(argv, a):
    """`batch --dp N` in the user's process: N replicas, then the merge (mindspec.dp)."""
    from .dp import launch, replicas_here
    if a.tp > 1:
        _topology(a)  # (its flags' errors: else each replica says them)
    cfg, m = _check_model_paths(a)  # (else each replica says it)
    if a.max_seq:  # (else each replica sizes its cache to its lines)
        _check_size(a, cfg, m, replicas=len(replicas_here(a.dp, a.nodes, a.node_rank)))
    return launch(argv, a.input, a.output, batch_job(a), a.dp, a.tp, a.nodes, a.node_rank)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error, as every other bad input gets (its usage stays in --help)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        # a value like "-1GB" or "-5x" is a (bad) value, not a flag: argparse before Python 3.13 took it
        # for an option and said only "expected one argument" (no option of ours looks like a number)
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message):  # ("mindspec: error:" as every other refusal: scripts match it; was "mindspec generate:")
        self.exit(2, f"mindspec: error: {message} (see {self.prog} --help)\n")


def parser():
    p = Parser(prog="mindspec", description="Speculative decoding: MindSpore target, ONNX draft.")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="export a draft checkpoint to ONNX (+ manifest)")
    e.add_argument("--model", type=path_arg, required=True, help="Hugging Face Llama checkpoint directory")
    e.add_argument("--out", type=path_arg, required=True, help="output .onnx path (manifest written to OUT.json)")
    e.add_argument("--quantize", choices=["q8", "int8", "q4", "none"], default=None,
                   help="the draft's weights: q8 (8-bit MatMulNBits, the default pair's), int8, q4, or none (float, "
                        "the default)")
    e.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    e.add_argument("--max-seq", type=positive_int, default=None, help="default KV-cache length for the draft")
    e.add_argument("--dtype", choices=["float32", "float16"], default=None,
                   help="weights and KV cache (norms and logits stay float32; default float32, "
                        "float16 with --profile ascend)")
    e.add_argument("--profile", choices=["cpu", "ascend"], default="cpu",
                   help="cpu: onnxruntime's CPU provider (default); ascend: CANN graph mode, static shapes, "
                        "the KV cache kept on the NPU (float16, no --quantize)")
    e.set_defaults(func=cmd_export)
    c = sub.add_parser("convert", help="convert a Llama GGUF file into a Hugging Face directory")
    c.add_argument("--gguf", type=path_arg, required=True, help="a Llama-family GGUF file")
    c.add_argument("--out", type=path_arg, required=True, help="the checkpoint directory to write (new or empty)")
    c.set_defaults(func=cmd_convert)
    g = sub.add_parser("generate", help="generate text with a target + draft pair")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt; - reads it from stdin (default: \"Once upon a time\")")
    g.add_argument("--prompt", dest="prompt_flag", default=None, metavar="TEXT",
                   help="the prompt, given as a flag instead of the argument")
    g.add_argument("--prompt-ids", type=_ids, default=None, help="comma-separated token ids instead of text")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_tp_arg(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's logprob under the target and its N best alternatives (0-20)")
    g.add_argument("--stats", action="store_true", help="print a table of acceptance and timing to stderr")
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="HTTP server speaking MindIE Service's APIs (OpenAI, TGI, /infer)")
    add_model_args(s, f"{SERVE_MAX_SEQ}: a server cannot resize its cache while requests run")
    add_sampling_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int_in(0, 65535), default=1025, help="port (default 1025 as MindIE; 0 = pick a free one)")
    add_batch_arg(s)
    s.add_argument("--max-queue", type=int_in(0), default=64,
                   help="requests that may wait for a row; beyond that a request is answered 429 at once (default 64)")
    s.add_argument("--max-queue-delay-us", type=int_in(0, 1_000_000), default=QUEUE_DELAY_US, metavar="US",
                   help="after a step that ended a request, how long the running rows wait for a new one to join "
                        f"the next step (MindIE's maxQueueDelayMicroseconds; default {QUEUE_DELAY_US}; 0 = never)")
    add_tp_arg(s)
    s.add_argument("--model-name", default=None,
                   help="the model's name in requests and /v1/models (default: the target directory's name)")
    s.add_argument("--config", type=path_arg, default=None, metavar="CONFIG.JSON",
                   help="MindIE Service's config.json (+ a 'mindspec' block) for these flags; flags given win")
    s.add_argument("--max-input-tokens", type=positive_int, default=None,
                   help="refuse (400) a prompt longer than this (MindIE's maxInputTokenLen; default: what fits)")
    s.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request naming another model (default: any name is this model)")
    s.add_argument("--max-connections", type=positive_int, default=1000,
                   help="open connections at most (MindIE's maxLinkNum); at it, the one idle longest is closed "
                   "for a new one, and with none idle the new one gets a 503 (default 1000)")
    s.add_argument("--read-timeout", type=positive_int, default=30,
                   help="seconds a request's headers, and then its body, may take to arrive; also how long an "
                        "idle connection stays open (default 30)")
    s.add_argument("--step-timeout", type=non_negative_number, default=STEP_TIMEOUT, metavar="S",
                   help="seconds one engine step may run (graph compiles not counted) before /health answers 503: "
                        f"a device or a tensor-parallel rank may hang (default {STEP_TIMEOUT}; 0 = never)")
    s.add_argument("--api-key", default=os.environ.get("MINDSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (health probes, /metrics and /version exempt; "
                        "default: $MINDSPEC_API_KEY, else none)")
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("batch", help="offline batch job over a JSONL file (resumable)")
    b.add_argument("--input", type=path_arg, required=True, help="JSONL: one request per line (- reads standard input)")
    b.add_argument("--output", type=path_arg, required=True,
                   help="JSONL results, appended; ids with a result there are skipped (failed ones run again)")
    add_model_args(b)
    add_sampling_args(b)
    b.add_argument("--chat", action="store_true", help="wrap plain \"prompt\" lines in the chat template")
    add_batch_arg(b)
    add_tp_arg(b)
    b.add_argument("--dp", type=int_in(1, 1024), default=1,  # (each replica a process holding the model)
                   help="N engine replicas (each of --tp devices; at most 1024), each running every N-th line into "
                        "its own part file beside the output; the parts are merged into it when all are complete")
    b.add_argument("--merge", action="store_true",
                   help="only merge the part files of a --dp job into the output (give the job's flags)")
    b.add_argument("--dp-replica", type=int, default=None, help=argparse.SUPPRESS)  # set by the --dp launcher
    b.set_defaults(func=cmd_batch)
    d = sub.add_parser("doctor", help="what runs where on this machine, and what an Ascend run still needs")
    d.add_argument("--device", choices=CHOICES, default=None, help="the device to check (default auto)")
    d.set_defaults(func=cmd_doctor)
    from . import bench, plan
    plan.add_parser(sub)
    bench.add_parser(sub)
    return p


def _run(args):
    if args.cmd == "generate" and args.prompt is None and args.prompt_ids is None:
        args.prompt = "Once upon a time"
    if args.cmd in HELD:
        code = _exit_code(lambda: _run_held(args))
    else:
        if args.cmd != "batch":  # batch unblocks them in run_batch, once it can still print its summary
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        code = _exit_code(lambda: args.func(args))
    signals.stopping(code)  # done: a signal in the teardown to come ends it quietly, with the command's code
    return code


def _run_held(args):
    """A HELD command's run: a Ctrl-C or SIGTERM waits for a safe point (mindspec.signals: raised inside
    MindSpore's import or compiler, it aborted the interpreter, was swallowed or dumped errors into
    ./rank_0), a second one exits at once."""
    om = OmDir()

    def hard_stop():
        om.remove()
        os._exit(130)
    ranked = getattr(args, "tp", 1) > 1 or getattr(args, "nodes", 1) > 1  # (its launcher handles signals)
    with Signals(not ranked, hard_stop, final=True) as sig, om:
        code = args.func(args)
        sig.check()  # (one that came after the last safe point)
    return code


def _exit_code(fn):
    """fn()'s exit code: bad input one line and 2, an interrupt 130."""
    try:
        code = fn() or 0
        sys.stdout.flush()  # (here, where a reader gone is a BrokenPipeError caught below)
        return code
    except MindspecError as e:
        from .tp import fail
        return fail(e)
    except KeyboardInterrupt:
        signals.stopping()  # (a second Ctrl-C must not raise in the teardown to come)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`| head`): quiet, as a shell's writer that SIGPIPE ended
        stdout.to_devnull()
        return 128 + signal.SIGPIPE
    except stdout.StdoutError as e:  # (found: `> /dev/full` a traceback; `>&-` an AttributeError traceback)
        from .tp import fail
        stdout.to_devnull()
        stdout.forget()  # (said)
        return fail(MindspecError(f"cannot write to stdout: {e.strerror or e}"))


def _dp_launcher(args):
    return args.cmd == "batch" and args.dp > 1 and args.dp_replica is None and not args.merge


def _topology(args):
    """Where this command's msrun ranks run: a data-parallel replica on this machine alone (replica i on
    --master-port + i, or a free port), else the multi-node flags."""
    from . import tp
    if args.cmd == "batch" and args.dp > 1:  # (a TP probe's: --master-port was ignored there)
        port = args.master_port
        if port is not None and not 1024 <= port <= 65536 - args.dp:
            raise MindspecError(f"--master-port must be in 1024..{65536 - args.dp} with --dp {args.dp} (replica i "
                                f"runs its msrun on --master-port + i), got {port}")
        return tp.Topology(args.tp, master_port=0 if port is None or args.dp_replica is None
                           else port + args.dp_replica)
    return tp.topology(args.tp, args.nodes, args.node_rank, args.master_addr, args.master_port)


def _launch_tp(argv, args):
    """msrun's launch of this command over --tp ranks (refused first when the device has fewer)."""
    from . import tp
    check_tp(args.tp, detect_device(args.device))
    topo = _topology(args)  # (the layout's own errors first)
    _check_tp_heads(args)
    if args.cmd == "batch":
        from .batch import check_free, check_shared_input
        check_shared_input(args.input, "--tp", "rank")
        if args.dp_replica is None and topo.node_rank == 0:  # (found: 24 s to say it under --tp, once every rank
            check_free(args.output)  # had started; another node's ranks never lock it, rank 0 may hold it already)
    # a batch job whose rank died could not go on (exit 1 would say: some lines failed); one replica of --dp
    # exits 1 still, its launcher counting what it left unfinished
    job = args.cmd == "batch" and args.dp_replica is None
    died = (2, "; what it wrote is kept: run the same command again to resume") if job else (1, "")
    # a stop ends the ranks before rank 0 prints its summary (found: nothing said); node 0 writes the output
    stopped = (f"mindspec batch: stopped by a signal; what was written to {args.output} is kept: run the same "
               "command again to resume") if job and topo.node_rank == 0 else ""
    return tp.launch(argv, args.tp, topo=topo, device=args.device, product=args.cmd == "generate", died=died,
                     stopped=stopped)


def _check_tp_heads(args):
    """Each rank refuses more ranks than the target has heads, but only once msrun started them all
    (--tp 1000: hundreds of ~400 MB processes): the launcher reads the config first."""
    from .config import load_config
    from .default import default_target
    target = args.target or default_target()  # (not made yet: the ranks make it)
    if os.path.isfile(os.path.join(target, "config.json")):
        heads = load_config(target).num_attention_heads
        if args.tp > heads:
            raise MindspecError(f"--tp {args.tp} exceeds the target's {heads} attention heads (a rank holds one "
                                "at least)")


def _launch(args, start):
    """Run a launcher (msrun's or the data-parallel one) in the user's process: Ctrl-C and SIGTERM reach it
    (its children inherit the unblocked mask); bad flags: one line, exit 2."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _exit_code(start)
    finally:
        signal.signal(signal.SIGTERM, old)


def _given(argv):
    """The dests the command line sets itself: argv parsed again with every default removed (argparse keeps
    no public record of the flags a parse saw; comparing values with the defaults took `--port 1025`, the
    default, as not given, and a --config file overrode it)."""
    p, todo = parser(), []
    todo.append(p)
    while todo:
        for a in todo.pop()._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += a.choices.values()
            else:
                a.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _stdin_prompt(args):
    """generate's prompt "-": the text on stdin, one final newline dropped (the one echo or an editor adds;
    CRLF too), and a byte-order mark (Windows editors write one), as batch reads its input."""
    if args.tp > 1 or args.nodes > 1:  # (msrun's ranks do not share the user's stdin)
        raise MindspecError("the prompt on stdin (-) cannot reach tensor-parallel ranks: give it as an argument")
    term = signal.signal(signal.SIGTERM, signal.default_int_handler)  # (as later: 130, not killed)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # while it waits (nothing imports)
    try:
        text = sys.stdin.buffer.read().decode("utf-8").removeprefix("\ufeff")
        return text.removesuffix("\r\n") if text.endswith("\r\n") else text.removesuffix("\n")
    except UnicodeDecodeError:
        raise MindspecError("the prompt on stdin is not UTF-8 text") from None
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.signal(signal.SIGTERM, term)


def parse(argv):
    """The command's arguments: argparse's, then serve's --config file under the flags given, and checks
    that span flags (raises MindspecError)."""
    if not argv:  # a bare `mindspec`: what it can do, not an error line
        parser().print_help(sys.stderr)
        raise SystemExit(2)
    args = parser().parse_args(argv)
    if getattr(args, "config", None):
        from .mindie_config import apply
        apply(args, args.config, _given(argv))
    if getattr(args, "temperature", None) is not None:
        check_sampling_args(args)
    if getattr(args, "no_speculate", False) and args.k != "auto" and "k" not in _given(argv):
        args.k = "auto"  # (a --config file's speculationGamma: the flag given wins)
    if getattr(args, "no_speculate", False) and args.k != "auto":
        raise MindspecError(f"-k {args.k} sets the draft tokens of a step: it does not apply with --no-speculate")
    if getattr(args, "k", "auto") != "auto" and args.target and not args.draft:  # (the embedded draft: its target's)
        raise MindspecError(f"-k {args.k} sets the draft tokens of a step: --target without --draft runs "
                            "target-only (give --draft)")
    if args.cmd == "serve":
        if args.max_seq is None:
            args.max_seq = SERVE_MAX_SEQ  # a server cannot resize its cache while requests run
        if args.max_input_tokens is not None:  # (MindIE's min(maxInputTokenLen, maxSeqLen - 1): a position to generate)
            args.max_input_tokens = min(args.max_input_tokens, max(args.max_seq - 1, 1))
    if args.cmd == "batch" and args.input == "-":
        args.input = "/dev/stdin"  # (as `generate -` reads its prompt)
    if args.cmd == "generate":
        if args.prompt_flag is not None:
            if args.prompt is not None:
                raise MindspecError("give the prompt once: as an argument or with --prompt")
            args.prompt = args.prompt_flag
        if args.prompt is not None and args.prompt_ids is not None:  # (was said once the model had loaded)
            raise MindspecError("give a text prompt or --prompt-ids, not both")
        args.limit_field = "--max-new-tokens" if "max_new_tokens" in _given(argv) else None  # (else cut to fit)
        if args.prompt == "-":
            args.prompt = _stdin_prompt(args)
    if args.cmd in MODEL_COMMANDS + ("bench", "doctor"):  # the commands that import MindSpore
        check_device_env()
    if args.cmd == "batch" and args.chat and not args.merge:  # (before any launcher, rank or replica starts)
        from .batch import check_chat
        check_chat(args.target)
    if getattr(args, "dp_replica", None) is not None and not 0 <= args.dp_replica < args.dp:  # (the launcher's flag)
        raise MindspecError(f"--dp-replica {args.dp_replica} is not a replica of --dp {args.dp}")
    if getattr(args, "nodes", None) is not None:  # before any path (a --dp launcher ran replicas 6, 7 of 2)
        from .tp import check_node_rank
        args.node_rank = check_node_rank(args.nodes, args.node_rank)
    return args


def main(argv=None):
    console = argv is None  # (the `mindspec` command: it ends the process itself, see the end)
    # no KeyboardInterrupt inside the imports to come (numpy, MindSpore: a half-imported MindSpore crashes
    # the interpreter at exit): signals wait for _run / run_batch
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    if console:
        stdout.hold()  # (a caller's own stdout is left alone)
    argv = sys.argv[1:] if argv is None else list(argv)
    parsed = []
    try:
        code = _exit_code(lambda: parsed.append(parse(argv)))
    except SystemExit as e:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        if e.code == 0:  # --help: its text written (argparse drops a failed write)
            code = _exit_code(lambda: None)
            if code:
                raise SystemExit(code) from None
        raise
    if code:
        return code
    args = parsed[0]
    if getattr(args, "device", None):  # msrun's ranks and the replicas detect the device the same way
        os.environ[DEVICE_ENV] = args.device
    for name, value in (getattr(args, "device_env", None) or {}).items():  # a MindIE config's npuDeviceIds,
        if value is None:                                                     # before CANN or msrun starts
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if _dp_launcher(args):
        return _launch(args, lambda: launch_dp(argv, args))
    if args.cmd in MODEL_COMMANDS and (args.tp > 1 or args.nodes > 1):
        from . import tp
        if not tp.is_worker():  # the user's process: run this same command on N ranks under msrun
            import random
            # every rank must draw the same uniforms: sampled requests without a seed (generate's, a batch's
            # lines) take theirs from this base (rank 0's, on several machines: tp.run_worker)
            os.environ.setdefault(SEED_ENV, str(random.randrange(2 ** 31)))
            return _launch(args, lambda: _launch_tp(argv, args))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        return tp.run_worker(lambda: _run(args), args.tp)  # one rank (msrun's scheduler exits inside)
    # SIGTERM = Ctrl-C (MindSpore's own SIGINT handler turns Ctrl-C into SIGTERM): exit 130, and a batch job
    # still prints its summary. (Under TP the launcher stops the ranks.)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    code = _run(args)
    if console and "mindspore" in sys.modules:  # done, nothing left to keep: no teardown of the pipeline's
        for f in (sys.stdout, sys.stderr):  # graphs, which took 0.65 s after a generate, 5 s for a server
            try:                            # holding every graph, 45 s at 13.8 GB (an orchestrator's 30 s
                f.flush()                   # grace kills it)
            except (OSError, ValueError):
                pass
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
