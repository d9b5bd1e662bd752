"""`mindspec.load(...)` -> Pipeline: target + draft + tokenizer, and `generate` over the shared loop."""
import os
import time
from dataclasses import dataclass

from .checkpoint import Checkpoint
from .errors import MindspecError
from .loop import Stats, decode
from .proposer import OnnxProposer
from .sampling import SamplingParams
from .tokenizer import StreamDecoder, Tokenizer

SEQ_ROUND = 256  # max_seq grows in steps of this: each size is a new set of compiled graphs
DEFAULT_BUCKETS = (1, 2, 4, 8)


@dataclass
class Result:
    token_ids: list
    text: str
    stats: dict
    finish_reason: str  # "stop" (EOS or stop string) or "length"


def _round_up(n, m):
    return (n + m - 1) // m * m


class Pipeline:
    def __init__(self, target, draft=None, k="auto", max_seq=None, buckets=DEFAULT_BUCKETS, device=None,
                 device_mem=None, tp=1):
        from mindspec.graphs.runner import init_mindspore
        self.k = self._check_k(k, buckets)
        self.buckets = tuple(sorted(set(buckets) | ({self.k} - {"auto"})))
        self.ckpt = Checkpoint(target)
        self.cfg = self.ckpt.config
        self.tokenizer = Tokenizer(target)
        if self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise MindspecError(f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size "
                                f"is {self.cfg.vocab_size}")
        self.eos = set(self.cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.target = None
        self.set_draft(draft)
        self.fixed_max_seq = max_seq
        self.device_mem, self.tp = device_mem, tp  # bytes per device: refuse what cannot fit
        self.device = init_mindspore(device)
        from .default import home
        self.cache_dir = os.path.join(home(), "compile_cache")  # see TargetModel.warmup
        if max_seq:
            self._build(max_seq)

    def _check_draft(self, path):
        from mindspec.export import read_manifest
        m = read_manifest(path)
        if m["vocab_size"] != self.cfg.vocab_size:
            raise MindspecError(f"draft {path} has vocabulary size {m['vocab_size']}, the target has "
                                f"{self.cfg.vocab_size}: a draft must share its target's tokenizer")
        fp = m.get("tokenizer_fingerprint")
        if fp and fp != self.tokenizer.vocab_fingerprint():
            raise MindspecError(f"draft {path} was exported from a model with a different tokenizer "
                                f"({m.get('source')}): a draft must share its target's tokenizer")
        return m

    @staticmethod
    def _check_k(k, buckets):
        if k == "auto":
            return k
        if not isinstance(k, int) or not 1 <= k <= max(buckets):
            raise MindspecError(f"-k must be between 1 and the largest K bucket {max(buckets)} (or auto), got {k}")
        return k

    def _policy(self, k):
        """FixedK for an int, DynamicK for "auto" (costs measured once per pipeline, cached on disk)."""
        from .policy import DynamicK, FixedK, measure_costs
        if k != "auto":
            return FixedK(k, self.buckets)
        if self._dynamic is None:
            if self.costs is None:
                self.costs = measure_costs(self)
            self._dynamic = DynamicK(self.buckets, *self.costs)
        return self._dynamic  # decode() resets it per request

    def set_draft(self, path):
        """Swap the draft (None: target-only), keeping the compiled target."""
        self.manifest = self._check_draft(path) if path else None
        self.draft_path = path or None
        self._open_draft()

    def _open_draft(self):
        """The draft session, its cache sized like the target's (none before the target exists).
        Resets the dynamic-K costs, which depend on the pair and the cache size."""
        from mindspec.export import DraftSession
        self.proposer = None
        self.costs = None  # (c, v) for dynamic K, measured on first use
        self._dynamic = None  # one DynamicK per pipeline: its acceptance prior carries across requests
        if self.draft_path and self.target is not None:
            self.proposer = OnnxProposer(DraftSession(self.draft_path, max_seq=self.target.max_seq))

    def _build(self, max_seq):
        """(Re)build the target graphs and the draft cache for `max_seq` positions."""
        from mindspec.graphs.runner import TargetModel
        if max_seq > self.cfg.max_position_embeddings:
            raise MindspecError(f"{max_seq} positions exceed the model's max_position_embeddings "
                                f"{self.cfg.max_position_embeddings}")
        if self.device_mem:  # before any weight is loaded (the target here keeps fp32 weights)
            from .plan import check_fits, shape_from_config, shape_from_draft
            check_fits(shape_from_config(self.cfg, "fp32"),
                       shape_from_draft(self.draft_path, "fp32") if self.draft_path else None,
                       tp=self.tp, device_mem=self.device_mem, seq_len=max_seq)
        self.target = TargetModel(self.ckpt, max_seq, self.buckets)
        self._open_draft()

    def _capacity(self, n_prompt, max_new_tokens):
        if self.fixed_max_seq:
            if n_prompt + 1 > self.fixed_max_seq:
                raise MindspecError(f"prompt is {n_prompt} tokens; it does not fit max_seq {self.fixed_max_seq}")
            return
        need = min(_round_up(n_prompt + max_new_tokens + max(self.buckets) + 1, SEQ_ROUND),
                   self.cfg.max_position_embeddings)
        if n_prompt + 1 > need:
            raise MindspecError(f"prompt is {n_prompt} tokens; the model takes at most "
                                f"{self.cfg.max_position_embeddings - 1}")
        if self.target is None or self.target.max_seq < need:
            self._build(need)

    def encode(self, prompt=None, prompt_ids=None, chat=False):
        if (prompt is None) == (prompt_ids is None):
            raise MindspecError("give exactly one of a prompt or prompt ids")
        if prompt_ids is not None:
            ids = [int(i) for i in prompt_ids]
            bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
            if bad:
                raise MindspecError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        else:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            ids = self.tokenizer.encode(text)
        if not ids:
            raise MindspecError("the prompt is empty")
        return ids

    def generate(self, prompt=None, prompt_ids=None, max_new_tokens=64, temperature=0.0, seed=None,
                 stop=None, chat=False, on_text=None, k=None, speculate=True, top_k=0, top_p=1.0,
                 repetition_penalty=1.0, draft_temperature=None, draft_min_conf=None):
        """Generate (greedy at temperature 0, else speculative sampling: the target's distribution
        exactly, whatever the draft); `on_text(delta)` receives text as it is produced. `k` overrides the
        pipeline's K for this call (a compiled bucket, or "auto" for dynamic K); speculate=False
        decodes with the target alone through the same graphs (the baseline). `draft_min_conf` stops
        drafting before a token the draft itself gives less than that probability (off by default: it
        measured slower for the default self-draft, see README)."""
        k = self.k if k is None else k
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k not in self.buckets):
            raise MindspecError(f"K={k!r} is not a compiled bucket {list(self.buckets)}")
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, draft_temperature, seed)
        sampling = not params.greedy or params.repetition_penalty != 1.0
        if draft_min_conf is not None and not 0 < draft_min_conf < 1:
            raise MindspecError(f"draft_min_conf must be between 0 and 1, got {draft_min_conf}")
        if max_new_tokens < 1:
            raise MindspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = self.encode(prompt, prompt_ids, chat)
        self._capacity(len(ids), max_new_tokens)
        compile_s = self.target.compile_s
        spec = speculate and self.proposer is not None
        ks = ([k] if k != "auto" else self.buckets) if spec else []
        if sampling:
            self.target.warmup_sample(params, ks, self.cache_dir)
        else:
            self.target.warmup(ks, self.cache_dir)
        policy = self._policy(k) if spec else None
        if spec:
            self.proposer.min_conf = draft_min_conf
        stats, out, finish, cut = Stats(), [], "length", False
        stream, text, shown = StreamDecoder(self.tokenizer), "", 0
        stops = [s for s in (stop or []) if s]
        hold = max((len(s) for s in stops), default=1) - 1  # never stream a half-seen stop string
        t0 = time.perf_counter()
        for new in decode(self.target, self.proposer if spec else None, ids, max_new_tokens, policy, stats,
                          params if sampling else None):
            for tok in new[:max_new_tokens - len(out)]:  # the last step may overshoot
                out.append(tok)
                if tok in self.eos:
                    finish = "stop"
                    break
                text += stream.push([tok])
                hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if hit >= 0:
                    text, finish, cut = text[:hit], "stop", True
                    break
            if finish == "stop":
                break
            if on_text and len(text) - hold > shown:
                on_text(text[shown:len(text) - hold])
                shown = len(text) - hold
        if not cut:
            text += stream.flush()
        stats.new_tokens = len(out)
        stats.wall_s = time.perf_counter() - t0
        stats.compile_s = self.target.compile_s - compile_s
        if on_text and len(text) > shown:
            on_text(text[shown:])
        return Result(out, text, stats.as_dict(), finish)


def load(target=None, draft=None, k="auto", **kw):
    """Load a target checkpoint dir and an ONNX draft (None: target-only). With no target, the
    embedded default pair (SmolLM2-135M-Instruct and its 8-bit self-draft) is used; draft=False
    then loads the default target alone."""
    if target is None:
        from .default import default_pair
        target, default_draft = default_pair()
        draft = default_draft if draft is None else draft
    return Pipeline(target, draft or None, k=k, **kw)
