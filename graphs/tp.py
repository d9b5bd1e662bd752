"""Tensor parallelism for the target: the communication state and how weights are split over ranks.

Megatron-style, N ranks (msrun workers), each holding a 1/N slice of every big matrix:
  q|k|v|rot(q)|rot(k)  column-parallel by heads   (each rank: its query heads + the KV heads they need)
  o_proj               row-parallel (input columns) + 1 AllReduce
  gate|up              column-parallel            (intermediate split in N contiguous ranges)
  down_proj            row-parallel               + 1 AllReduce
  embedding            vocab-parallel             (own vocab range, zero elsewhere) + 1 AllReduce
  LM head              vocab-parallel             + 1 AllGather (logits) or of (max, index) pairs (greedy)
So one target call costs 2 * layers + 1 AllReduces of [B*T, hidden] and one AllGather.

Uneven splits are padded, never refused when they can work: a query head range that cuts a GQA
group replicates that group's KV head on both ranks (its K/V rows are computed twice, its cache is
stored twice), and every rank gets the same number of KV-head slots x query slots per KV head, so all
ranks run the same shapes; empty slots have zero weights (their o_proj columns are zero too, so they add
nothing). When that pads too much (e.g. 9 heads in groups of 3 over 4 ranks) each query head gets its
own copy of its KV head instead (one query slot per KV slot), whichever needs fewer rows. The
intermediate size and the vocabulary are padded up to a multiple of N the same way (padded vocabulary
columns are masked out of the logits). Refused: more ranks than query heads.
With N = 1 the plan is the identity and nothing is padded.

TP degree and rank come from MindSpore's communication state: tp_size() is 1 and tp_rank() 0 unless
init_tp() initialised collectives (in an msrun worker), so single-device code needs no argument.
"""
import os
from dataclasses import dataclass

import numpy as np

from mindspec.errors import MindspecError

_STATE = {"size": 1, "rank": 0}


def tp_size():
    return _STATE["size"]


def tp_rank():
    return _STATE["rank"]


def tp_layout():
    """(size, rank): anything cached per compiled graph (MindSpore's compile cache) must be keyed by it,
    since each rank's graph differs and MindSpore separates its cache by rank id only."""
    return _STATE["size"], _STATE["rank"]


def in_msrun():
    """True in a process msrun started (a worker, or the scheduler, which runs the same command)."""
    return os.environ.get("MS_ROLE") in ("MS_WORKER", "MS_SCHED")


def init_tp(device=None):
    """Initialise MindSpore collectives in an msrun worker (HCCL on Ascend, MindSpore's CPU collectives on
    CPU) and record size/rank. Call it first thing: in msrun's scheduler process init() runs the
    scheduler and the process exits when the job ends, so nothing after this runs there."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init
    from mindspec.device import detect_device, device_id
    device = detect_device(device)
    ms.set_context(mode=ms.GRAPH_MODE)
    # an explicit id: with the default one msrun negotiates a per-rank id, and the pipeline's own later
    # set_device(device) (id 0) is then refused as a change. CPU ranks all use "device" 0; NPU ranks
    # their local rank (runner.init_mindspore must then not set the device again).
    ms.set_device(device, 0 if device == "CPU" else device_id())
    init()
    _STATE["size"], _STATE["rank"] = get_group_size(), get_rank()
    return _STATE["size"], _STATE["rank"]


_SUM_CELLS = {}


def all_reduce_sum(x):
    """Element-wise sum over ranks of a small float32 numpy array (one compiled graph per shape); every
    rank gets the same bits. Identity without TP."""
    if tp_size() == 1:
        return np.asarray(x, np.float32)
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    class _Sum(nn.Cell):
        def __init__(self):
            super().__init__()
            self.ar = ops.AllReduce()

        def construct(self, x):
            return self.ar(x)

    from .cache_budget import compile_env
    x = np.ascontiguousarray(x, np.float32)
    new = x.shape not in _SUM_CELLS  # (its first call compiles: never through a host's compile cache)
    cell = _SUM_CELLS.setdefault(x.shape, _Sum())
    with compile_env(None if new else False):
        return cell(Tensor(x, ms.float32)).asnumpy()


def _split(n_items, size, rank):
    """Near-equal contiguous ranges: rank's [start, stop) of n_items."""
    return n_items * rank // size, n_items * (rank + 1) // size


@dataclass(frozen=True)
class ShardPlan:
    """Which rows/columns of each weight a rank holds, and how its heads are laid out.

    q_slots [KVl, Gl]: the global query head in each slot (-1: empty), grouped under kv_slots [KVl]
    (global KV head or -1). The graph treats the rank as a model with KVl KV heads of Gl query heads."""
    size: int
    rank: int
    q_slots: np.ndarray
    kv_slots: np.ndarray
    inter: tuple  # (start, stop) of the intermediate (gate/up rows, down columns) this rank holds
    inter_local: int  # padded local width
    vocab: tuple  # (start, stop) of the vocabulary this rank holds
    vocab_local: int  # padded local width; the rank's logits column j is token vocab[0] + j

    @property
    def kv_local(self):
        return self.q_slots.shape[0]

    @property
    def group_local(self):
        return self.q_slots.shape[1]

    @property
    def heads(self):
        """(start, stop) of the query heads of this rank (contiguous)."""
        q = self.q_slots[self.q_slots >= 0]
        return int(q.min()), int(q.max()) + 1

    @property
    def kv_heads(self):
        k = self.kv_slots[self.kv_slots >= 0]
        return int(k.min()), int(k.max()) + 1

    @property
    def padded(self):
        return bool((self.q_slots < 0).any() or (self.kv_slots < 0).any())


def shard_plan(cfg, size=1, rank=0):
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    if not 0 <= rank < size:
        raise ValueError((rank, size))
    if size > H:
        raise MindspecError(f"tensor parallelism {size} exceeds the target's {H} attention heads: "
                            f"use --tp {H} or less")
    G = H // KV

    def groups(r):  # {kv head: [its query heads on rank r]}
        a, b = _split(H, size, r)
        out = {}
        for h in range(a, b):
            out.setdefault(h // G, []).append(h)
        return out

    all_groups = [groups(r) for r in range(size)]
    KVl = max(len(g) for g in all_groups)
    Gl = max(len(q) for g in all_groups for q in g.values())
    mine = sorted(all_groups[rank].items())
    flat = max(sum(len(q) for q in g.values()) for g in all_groups)
    if flat * 3 < KVl * (Gl + 2):  # fewer slots (q + k + v rows) with one KV copy per query head
        KVl, Gl = flat, 1
        mine = [(kv, [h]) for kv, qs in mine for h in qs]
    q_slots = np.full((KVl, Gl), -1, np.int64)
    kv_slots = np.full(KVl, -1, np.int64)
    for j, (kv, qs) in enumerate(mine):
        kv_slots[j] = kv
        q_slots[j, :len(qs)] = qs
    I, V = cfg.intermediate_size, cfg.vocab_size
    Il, Vl = -(-I // size), -(-V // size)
    return ShardPlan(size, rank, q_slots, kv_slots, (min(rank * Il, I), min((rank + 1) * Il, I)), Il,
                     (min(rank * Vl, V), min((rank + 1) * Vl, V)), Vl)


def comm_per_call(cfg, size, tokens, batch=1, dtype_bytes=4, greedy=True):
    """Collectives of one target call over `tokens` positions at TP=size: (allreduces, allgathers,
    bytes each rank sends, ring algorithm: an AllReduce of n bytes sends 2n(N-1)/N, an AllGather of
    n bytes per rank sends n(N-1))."""
    if size == 1:
        return 0, 0, 0
    rows = batch * tokens
    ar = 2 * cfg.num_hidden_layers + 1
    ar_bytes = rows * cfg.hidden_size * dtype_bytes * 2 * (size - 1) / size
    ag_bytes = rows * (2 * 4 if greedy else -(-cfg.vocab_size // size) * 4) * (size - 1)
    return ar, 1, int(ar * ar_bytes + ag_bytes)
