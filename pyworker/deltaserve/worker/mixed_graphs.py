"""CUDA-graph capture and replay of prefill and mixed (prefill + decode) steps, by token-count bucket.

A step with a prefill chunk used to run eagerly: ~1,900 small kernels per forward issued one by one
from Python, 2-3x the replayed step at the sizes continuous batching forms. Here every step whose
tokens fit a bucket replays one whole-forward graph; beyond the largest bucket it runs eagerly.

Why whole graphs, not piecewise ones with attention run eagerly between them (vLLM v1, SGLang): our
Triton prefill attention already reads every length on the device and exits programs past a
sequence's rows, so only its grid depended on the step (``max_query_len`` x sequences). Given a
tile table (``kernels.paged_attention.prefill_tiles``: one program per (sequence, query tile),
rows of sequence -1 idle) its grid is fixed per bucket, and the whole forward captures. Piecewise
graphs would still launch ~2 pieces and one attention per layer from Python (tens of launches of
~20 us host time each per step).

Layout (static, sized for the largest bucket T tokens and S = min(T, max_seqs) sequences)::

    int64: input_ids, positions, slot_mapping [T] | logits_indices [S]        one host-to-device copy
    int32: query_start_loc [S + 2] | seq_lens [S + 1] | attention tiles [cdiv(T, BQ) + S + 1, 2]
           | how many attention tiles are real [1]
           | LoRA seg_adapter [S + 1] | LoRA SGMV tiles [cdiv(T, SGMV_TILE) + S, 2]
           | LoRA MBGMV rows [S] | their slots [S]                              one copy
    block_tables [S + 1, max_blocks] int32                                    rows [0, n) copied
    logits [S, vocab] float32: every graph copies its logits here (one buffer, not one per graph)

    bucket Tb (smallest >= the step's tokens), Sb = min(Tb, S):
      sequences [0, n)      the step's, tokens [0, t)
      sequence n            padding: tokens [t, Tb), seq_len 0 (attention writes zeros), K/V to
                            the scratch slot, positions 0, no LoRA segment
      sequences (n, Sb]     empty (query_start_loc = Tb)
      logits rows [0, m)    the step's logits_indices; rows [m, Sb) read row 0 and are dropped
      max_query_len = Tb, max_seq_len = the static maximum (as the decode graphs)

LoRA rows: each bucket has a second graph captured with the adapted linears active over static mixed
metadata (``LoraMeta.mixed_step``'s layout: segments = the sequences, seg_start = query_start_loc;
SGMV tiles as ``sgmv_tiles`` gives them for the sequences of several tokens, then idle tiles of the
padding segment; the one-token sequences with an adapter on MBGMV's row list, then padding rows of
slot -1), as the eager step's ``LoraPool.begin_segments`` builds it. The pool's slot tables are
static (``LoraPool.assign_rows``), as for the LoRA decode graphs. Buckets of at most
``CHUNK_LORA_MAX_TOKENS`` tokens have a third graph, captured without the MBGMV row list: a step
whose one-token sequences have no adapter (a lone prompt, a prefix-cache hit) replays it and skips
the row kernels' launches over padding rows, which compute nothing (the same bits).

Every real program computes what the eager step's program of the same tile computes (one-token
sequences: the decode attention kernel, one split, in both; prefill tiles split their keys over as
many programs in both, since the split count depends only on the step's token bucket:
``kernels.paged_attention.PREFILL_SPLIT_TOKENS``), so attention and LoRA match the eager step bit
for bit; the dense matmuls see Tb rows instead of t, and cuBLAS may pick another kernel, as for the
decode graphs' padded buckets (Llama-2-7B shape, fp16, H100: identical logits at 192 of 192 and 576
of 640 tokens, up to 0.034 apart at 96 of 128; ``bench/mixed_step.py``): tests compare tokens. Steps
with prompt logprobs or CPU-assisted cold prefills run eagerly (``ForwardRunner.forward``).

Compressed-delta rows: a step of at most ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS`` tokens (default 512;
0: eager) whose deltas' packed configs the
CUDA SBMM op takes replays a graph of its *delta bucket* (``DELTA_TOKEN_BUCKETS``), its packed
configs, its dense lane's config and whether it has LoRA rows. When the first delta of a config is
registered the executor captures that config's graphs without LoRA (``capture_config``: each bucket's
tiles, and its lanes where the bucket can hold one), as it does the delta decode graphs; other
combinations are captured the first time such a step comes. The delta-aware modules read the delta pool's mixed-step buffers
(``DeltaPool.mixed_graph_state`` / ``fill_mixed_rows``): every token is a row of the SBMM metadata,
so a prompt's tokens share their delta's work tiles of ``GRAPH_TILE`` tokens (the eager step
instead dequantises a long prompt's delta once and runs cuBLAS: the graph's sums are the same
products in another order, so tests compare tokens); the logits rows have their own index and
lm_head tiles. A prompt long enough for the bucket (``adapters.delta_graphs.dense_lane_tokens``) runs
its delta in the graph's *dense lane* instead: one dequantisation per linear from offsets written
before the replay, and one matmul over the bucket masked to its rows, as the eager step's dense
segments compute it; such a step replays a graph captured with a lane for its delta's config.

``capture=False`` runs the same static-buffer forward eagerly (CPU tests: the padding logic against
today's path). The graphs share the decode graphs' memory pool; ``DELTASERVE_CUDA_GRAPH_MAX_TOKENS``
(default 2048: a saturated S-LoRA S1 run on an H200 served 12 % more requests per second than with
512; 0: off) bounds the largest bucket.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from deltaserve.adapters.delta_graphs import dense_lane_tokens
from deltaserve.adapters.delta_loads import LAUNCH_LOCK
from deltaserve.adapters.variants import StepRows
from deltaserve.kernels.lora import SGMV_TILE, LoraMeta, sgmv_tiles, single_rows
from deltaserve.kernels.paged_attention import prefill_block_q, prefill_tiles
from deltaserve.model import DecoderLM, ForwardBatch, PagedKVCache
from deltaserve.model.batch import copy_from_host

from .cuda_graphs import buckets_up_to

if TYPE_CHECKING:
    from deltaserve.adapters.delta_pool import DeltaPool
    from deltaserve.adapters.lora_pool import LoraPool

log = logging.getLogger(__name__)

#: Step token counts that get a graph (a step runs in the smallest bucket that holds it). Every
#: padding row costs the step's dense matmuls a row, and from a few hundred tokens those matmuls are
#: compute-bound, so the buckets are 32 tokens apart up to 256, 64 up to 768, then 128 and 256:
#: from 256 tokens to the default largest bucket (2,048) a step pads by at most 20 % (it was up to
#: 50 %, 257 -> 384 and 1,025 -> 1,536).
TOKEN_BUCKETS = (
    16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640, 704, 768, 896, 1024,
    1152, 1280, 1408, 1536, 1792, 2048, 3072, 4096,
)  # fmt: skip
MAX_TOKENS_ENV = "DELTASERVE_CUDA_GRAPH_MAX_TOKENS"
#: Largest bucket unless ``DELTASERVE_CUDA_GRAPH_MAX_TOKENS`` says otherwise.
DEFAULT_MAX_TOKENS = 2048
#: Buckets up to this many tokens also get a LoRA graph without MBGMV rows (module docstring): the
#: steps behind a lone request's TTFT, where 128 row launches over padding are a few percent of the
#: step. Larger buckets would add capture time for a share that shrinks with the step.
CHUNK_LORA_MAX_TOKENS = 256
#: Token buckets of steps with compressed-delta rows (up to ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS``;
#: module docstring). Coarser than ``TOKEN_BUCKETS``: each (bucket, packed configs, LoRA) graph is
#: captured when a step first needs it, in that step, and a padding token costs a delta step less than
#: the SBMM work tiles.
DELTA_TOKEN_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
DELTA_MAX_TOKENS_ENV = "DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS"
DEFAULT_DELTA_MAX_TOKENS = 512
"""Most tokens of a step with delta rows replayed from a graph unless ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS``
says otherwise (0: such steps run eagerly). An eager delta step pays the launching thread for its
~800-1,000 kernels; a captured one runs a short delta run on the SBMM work tiles of ``GRAPH_TILE``
tokens (each reading the delta again) and a long prompt's delta in the dense lane
(``adapters.delta_graphs``). Llama-2-7B shape, 4-bit 2:4, H200, one prompt of one delta
(``bench/README.md``): replayed 31.8 ms at 512 tokens against 53.8 eager; at 1,024 55.2 against 56.9,
a tie that does not pay for the graphs of two more buckets captured mid-serving (a 30 s DeltaZip run
with the limit at 1,024 captured 14). Beyond the limit the step runs eagerly; the router keeps the
prompt chunks of steps with delta rows within it (``MixedGraphs.delta_graph_tokens``, in the Hello)."""


def _tokens_from_env(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: want a token count 0..{TOKEN_BUCKETS[-1]}") from None
    if not 0 <= value <= TOKEN_BUCKETS[-1]:
        raise ValueError(f"{name}={value}: want 0..{TOKEN_BUCKETS[-1]}")
    return value


def max_tokens_from_env() -> int:
    """``DELTASERVE_CUDA_GRAPH_MAX_TOKENS`` (0: no mixed-step graphs), default ``DEFAULT_MAX_TOKENS``."""
    return _tokens_from_env(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS)


def delta_max_tokens_from_env() -> int:
    """``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS`` (0: steps with delta rows run eagerly), default
    ``DEFAULT_DELTA_MAX_TOKENS``."""
    return _tokens_from_env(DELTA_MAX_TOKENS_ENV, DEFAULT_DELTA_MAX_TOKENS)


def token_buckets_up_to(max_tokens: int) -> list[int]:
    """The capture sizes for steps of at most ``max_tokens`` tokens (it is always one)."""
    return buckets_up_to(max_tokens, TOKEN_BUCKETS)


class MixedGraphs:
    """Captured forwards of ``model`` over ``kv`` for steps of any shape up to ``max_tokens`` tokens
    and ``max_seqs`` sequences (module docstring)."""

    def __init__(
        self,
        model: DecoderLM,
        kv: PagedKVCache,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        scratch_slot: int,
        lora: LoraPool | None = None,
        pool: Any = None,
        capture: bool = True,
        deltas: DeltaPool | None = None,
        max_delta_tokens: int | None = None,
    ) -> None:
        if max_tokens < 1 or max_seqs < 1:
            raise ValueError(f"MixedGraphs: max_tokens and max_seqs must be >= 1, got {max_tokens}, {max_seqs}")
        device = kv.device
        cfg = model.config
        self.model = model
        self.kv = kv
        self.lora = lora
        """The adapter pool whose slot tables the LoRA graphs read; None: base graphs only."""
        self.deltas = deltas
        """The delta pool whose static buffers the delta graphs read; None: steps with deltas run eagerly."""
        self.capture = capture
        """False: ``run`` runs the static forward eagerly (no graphs; CPU tests)."""
        self.sizes = token_buckets_up_to(max_tokens)
        if max_delta_tokens is None:
            max_delta_tokens = delta_max_tokens_from_env()
        self.delta_sizes = buckets_up_to(min(max_tokens, max_delta_tokens), DELTA_TOKEN_BUCKETS)
        """Token buckets of steps with delta rows (``DELTA_TOKEN_BUCKETS`` up to ``max_delta_tokens``, None:
        the env's ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS``; none: such steps run eagerly)."""
        self.max_tokens = max_tokens
        """Most tokens a step replayed here may have."""
        self.max_seqs = min(max_seqs, max_tokens)
        """Most sequences a step replayed here may have."""
        self.scratch_slot = scratch_slot
        """KV slot where padding tokens write (outside the router's pool)."""
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.max_seq_len = self.max_blocks * kv.block_size
        """Static bound on every context (the reference attention on CPU shapes its mask by it)."""
        self.block_q = prefill_block_q(cfg.num_heads, cfg.num_kv_heads, device.type != "cuda")
        """Query tokens per attention program: sizes the tile tables."""
        T, S = max_tokens, self.max_seqs
        regions64 = {"input_ids": T, "positions": T, "slot_mapping": T, "logits_indices": S}
        regions32 = {
            "query_start_loc": S + 2,
            "seq_lens": S + 1,
            "attn_tiles": 2 * self._attn_tiles(T),
            "attn_tile_count": 1,
            "seg_adapter": S + 1,
            "lora_tiles": 2 * self._lora_tiles(T),
            "lora_rows": S,
            "lora_row_slots": S,
        }
        self.host64 = torch.zeros(sum(regions64.values()), dtype=torch.long)
        self.host32 = torch.zeros(sum(regions32.values()), dtype=torch.int32)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.at64 = _offsets(regions64)
        self.at32 = _offsets(regions32)
        """Region name -> (start, length) in the packed int64 / int32 buffers."""
        self.block_tables = torch.zeros((S + 1, self.max_blocks), dtype=torch.int32, device=device)
        self.logits = torch.zeros((S, cfg.vocab_size), dtype=torch.float32, device=device)
        """Every graph's logits rows land here (the step's first m are returned)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.chunk_lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        """LoRA graphs without the MBGMV row list, for buckets up to ``CHUNK_LORA_MAX_TOKENS``."""
        self.delta_graphs: dict[tuple[int, bool, tuple, tuple | None], torch.cuda.CUDAGraph] = {}
        """(delta bucket, with LoRA rows, the packed configs on the work tiles, the dense lane's config or None) -> its
        graph with the deltas active, captured when the config's first delta is registered (``capture_config``)
        or else the first time such a step comes (which configs serve is known only once deltas do)."""
        self.delta_replays = 0
        """Steps with delta rows served here."""
        self.lane_replays = 0
        """Of those, steps with a dense lane."""
        self.replays = 0
        """Steps served here so far (tests and logs check the graphs are really used)."""
        self.lora_replays = 0
        """Of those, steps with LoRA rows."""
        self.chunk_lora_replays = 0
        """Of those, steps whose one-token sequences had no adapter, run without the row list."""
        self.capture_seconds = 0.0
        self.pool = pool
        """The memory pool handle the graphs share (``torch.cuda.graph_pool_handle``: the decode graphs');
        None: the first capture's."""
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ layout

    def _seqs(self, tb: int) -> int:
        return min(tb, self.max_seqs)

    def _attn_tiles(self, tb: int) -> int:
        """Attention programs of bucket ``tb``: its tokens' tiles, one partial tile per sequence and the padding's."""
        return -(-tb // self.block_q) + self._seqs(tb) + 1

    def _lora_tiles(self, tb: int) -> int:
        return -(-tb // SGMV_TILE) + self._seqs(tb)

    def _view(self, name: str, length: int) -> torch.Tensor:
        if name in self.at64:
            start, size = self.at64[name]
            buf = self.dev64
        else:
            start, size = self.at32[name]
            buf = self.dev32
        assert length <= size, (name, length, size)
        return buf[start : start + length]

    def _host(self, name: str) -> torch.Tensor:
        if name in self.at64:
            start, size = self.at64[name]
            return self.host64[start : start + size]
        start, size = self.at32[name]
        return self.host32[start : start + size]

    def _batch(self, tb: int) -> ForwardBatch:
        s = self._seqs(tb)
        return ForwardBatch(
            input_ids=self._view("input_ids", tb),
            positions=self._view("positions", tb),
            query_start_loc=self._view("query_start_loc", s + 2),
            seq_lens=self._view("seq_lens", s + 1),
            block_tables=self.block_tables[: s + 1],
            slot_mapping=self._view("slot_mapping", tb),
            logits_indices=self._view("logits_indices", s),
            max_seq_len=self.max_seq_len,
            max_query_len=tb,
            attn_tiles=self._view("attn_tiles", 2 * self._attn_tiles(tb)).view(-1, 2),
            attn_tile_count=self._view("attn_tile_count", 1),
        )

    def _lora_meta(
        self, tb: int, seg_start: tuple[int, ...], seg_adapter: tuple[int, ...], rows: bool = True
    ) -> LoraMeta:
        """Mixed-step metadata over the static buffers of bucket ``tb``: the grids are its tile and row
        bounds; ``seg_*`` (the host copies the reference path reads) describe what the buffers hold now.
        ``rows`` False: no MBGMV row list (the chunk-only graph; every one-token sequence is base)."""
        s = self._seqs(tb)
        tiles = self._lora_tiles(tb)
        return LoraMeta(
            seg_start=self._view("query_start_loc", s + 2), seg_adapter=self._view("seg_adapter", s + 1),
            seg_start_host=seg_start, seg_adapter_host=seg_adapter, num_tokens=tb,
            max_adapter=max(0, *seg_adapter), decode=False,
            tiles=self._view("lora_tiles", 2 * tiles).view(-1, 2), num_tiles=tiles,
            rows=self._view("lora_rows", s) if rows else None,
            row_adapter=self._view("lora_row_slots", s) if rows else None, num_rows=s if rows else 0,
        )  # fmt: skip

    def _fill(
        self, tb: int, step: ForwardBatch | None, slots: list[int] | None
    ) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """Writes bucket ``tb``'s host buffers for ``step`` (None: every row padding, for capture) and
        the LoRA rows' ``slots`` (one per sequence, -1: base); returns the LoRA segments on the host
        and whether some one-token sequence has an adapter (an MBGMV row)."""
        s = self._seqs(tb)
        if step is None:
            n = t = m = 0
            qsl = [0]
        else:
            n, t, m = step.num_seqs, step.num_tokens, int(step.logits_indices.shape[0])
            qsl = step.query_start_loc.tolist()
        ids, pos, slot = self._host("input_ids"), self._host("positions"), self._host("slot_mapping")
        if step is not None:
            ids[:t] = step.input_ids
            pos[:t] = step.positions
            slot[:t] = step.slot_mapping
        ids[t:tb] = 0
        pos[t:tb] = 0
        slot[t:tb] = self.scratch_slot
        logits = self._host("logits_indices")
        if step is not None:
            logits[:m] = step.logits_indices
        logits[m:s] = 0
        starts = qsl + [tb] * (s + 1 - n)  # the padding sequence n, then empty ones
        self._host("query_start_loc")[: s + 2] = torch.tensor(starts, dtype=torch.int32)
        lens = self._host("seq_lens")
        if step is not None:
            lens[:n] = step.seq_lens
        lens[n : s + 1] = 0
        # Sequences of one token (decodes, maybe the padding) are the decode kernel's: no tiles.
        q_lens = [starts[i + 1] - starts[i] for i in range(n + 1)]
        tiles = prefill_tiles(q_lens, self.block_q, skip_single=True)
        attn = self._host("attn_tiles")[: 2 * self._attn_tiles(tb)]
        attn.fill_(-1)
        attn[: len(tiles)] = torch.tensor(tiles, dtype=torch.int32)
        self._host("attn_tile_count")[0] = len(tiles) // 2  # the kernel's programs loop over these
        seg_adapter = tuple((slots or [-1] * n) + [-1] * (s + 1 - n))
        rows: list[int] = []
        if slots is not None:
            self._host("seg_adapter")[: s + 1] = torch.tensor(seg_adapter, dtype=torch.int32)
            lora_tiles = sgmv_tiles(starts[: n + 1], slots, skip_single=True)
            buf = self._host("lora_tiles")[: 2 * self._lora_tiles(tb)]
            buf.view(-1, 2)[:, 0] = s  # idle tiles: the last segment, never an adapter's
            buf.view(-1, 2)[:, 1] = 0
            buf[: len(lora_tiles)] = torch.tensor(lora_tiles, dtype=torch.int32)
            rows, row_slots = single_rows(starts[: n + 1], slots)  # the decodes: MBGMV rows
            self._host("lora_rows")[:s] = torch.tensor(rows + [0] * (s - len(rows)), dtype=torch.int32)
            self._host("lora_row_slots")[:s] = torch.tensor(row_slots + [-1] * (s - len(rows)), dtype=torch.int32)
        return tuple(starts), seg_adapter, bool(rows)

    def _upload(self, tb: int, step: ForwardBatch | None) -> None:
        """Copies the host buffers (and the step's block tables) to the device buffers."""
        copy_from_host(self.dev64, self.host64)
        copy_from_host(self.dev32, self.host32)
        if step is not None:
            width = step.block_tables.shape[1]
            copy_from_host(self.block_tables[: step.num_seqs, :width], step.block_tables)

    # ------------------------------------------------------------------ capture

    def _forward_into_logits(self, tb: int) -> None:
        logits = self.model.forward(self._batch(tb), self.kv)
        self.logits[: logits.shape[0]].copy_(logits)

    def _capture_one(
        self, tb: int, lora: bool, rows: bool = True, keys: tuple | None = None, lane: tuple | None = None
    ) -> torch.cuda.CUDAGraph:
        """Bucket ``tb``'s graph (LoRA active over the static metadata when ``lora``, with the MBGMV
        row list when ``rows``; the deltas of packed configs ``keys`` over the delta pool's static
        buffers when given, with a dense lane for config ``lane`` when given). Two eager forwards first
        compile the kernels and allocate workspaces; every row is padding meanwhile."""
        seg_start, seg_adapter, _ = self._fill(tb, None, [] if lora else None)
        self._upload(tb, None)
        if lora:
            assert self.lora is not None
            self.lora.step.meta = self._lora_meta(tb, seg_start, seg_adapter, rows)
        try:
            with self._delta_state(tb, keys, lane):
                for _ in range(2):
                    self._forward_into_logits(tb)
                torch.cuda.synchronize(self.kv.device)
                graph = torch.cuda.CUDAGraph()
                with LAUNCH_LOCK, torch.cuda.graph(graph, pool=self.pool):  # no delta load launches meanwhile
                    self._forward_into_logits(tb)
        finally:
            if lora and self.lora is not None:
                self.lora.step.meta = None
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    def _delta_state(self, tb: int, keys: tuple | None, lane: tuple | None = None) -> AbstractContextManager[None]:
        """The delta pool's static buffers of bucket ``tb`` and configs ``keys`` (a dense lane for config
        ``lane``) while a graph is captured (``DeltaPool.mixed_graph_state``); nothing when ``keys`` is None."""
        if keys is None:
            return nullcontext()
        assert self.deltas is not None
        return self.deltas.mixed_graph_state(tb, self._seqs(tb), self.delta_sizes[-1], self.max_seqs, keys, lane)

    def _capture_all(self) -> None:
        started = time.monotonic()
        with torch.inference_mode():
            for tb in sorted(self.sizes, reverse=True):  # largest first: later graphs reuse its pool
                self.graphs[tb] = self._capture_one(tb, False)
                if self.lora is not None:
                    self.lora_graphs[tb] = self._capture_one(tb, True)
                    if tb <= CHUNK_LORA_MAX_TOKENS:
                        self.chunk_lora_graphs[tb] = self._capture_one(tb, True, rows=False)
        torch.cuda.synchronize(self.kv.device)
        self.capture_seconds = time.monotonic() - started
        log.info(
            "captured %d mixed-step CUDA graphs (tokens %s, up to %d sequences%s) in %.1f s",
            len(self.graphs) + len(self.lora_graphs) + len(self.chunk_lora_graphs),
            ",".join(map(str, sorted(self.sizes))),
            self.max_seqs,
            ", each also with LoRA" if self.lora_graphs else "",
            self.capture_seconds,
        )

    def _capture_delta(self, variant: tuple[int, bool, tuple, tuple | None]) -> None:
        """Captures the delta graph ``variant`` (``delta_graphs``' key)."""
        tb, lora, keys, lane_key = variant
        with torch.inference_mode():
            started = time.monotonic()
            self.delta_graphs[variant] = self._capture_one(tb, lora, keys=keys, lane=lane_key)
            log.info("captured the mixed-step graph of %d tokens with deltas %s%s%s in %.2f s", tb, list(keys),
                     "" if lane_key is None else f", a dense lane of {lane_key}",
                     " and LoRA" if lora else "", time.monotonic() - started)  # fmt: skip

    def config_variants(self, key: tuple) -> list[tuple[int, bool, tuple, tuple | None]]:
        """The delta graphs (``delta_graphs``' keys) a step whose deltas are all of packed config ``key``, with
        no LoRA row, can replay: per delta bucket its work tiles; and where the bucket can hold a dense lane
        (``dense_lane_tokens(tb) <= tb``), the lane beside tiles and the lane alone."""
        out: list[tuple[int, bool, tuple, tuple | None]] = []
        for tb in self.delta_sizes:
            out.append((tb, False, (key,), None))
            if dense_lane_tokens(tb) <= tb:
                out += [(tb, False, (key,), key), (tb, False, (), key)]
        return out

    def capture_config(self, key: tuple) -> int:
        """Captures ``config_variants(key)`` not captured yet (the executor, when the first delta of config
        ``key`` is registered, so that no served step stalls on them); returns how many."""
        missing = [v for v in self.config_variants(key) if v not in self.delta_graphs] if self.capture else []
        for variant in sorted(missing, key=lambda v: -v[0]):  # largest first, as at start-up
            self._capture_delta(variant)
        return len(missing)

    # ------------------------------------------------------------------ steps

    @property
    def delta_graph_tokens(self) -> int:
        """Most tokens a step with delta rows may have and replay here (the largest delta bucket; 0: no
        delta pool or no delta buckets). The worker's Hello says it, and the router keeps the prompt
        chunks of such steps within it, so that they replay instead of running eagerly."""
        return self.delta_sizes[-1] if self.deltas is not None and self.delta_sizes else 0

    def bucket_for(self, num_tokens: int, num_seqs: int, deltas: bool = False) -> int | None:
        """The smallest bucket (of ``delta_sizes`` when the step has ``deltas`` rows) holding a step of
        ``num_tokens`` tokens in ``num_seqs`` sequences (None: eager)."""
        if num_seqs > self.max_seqs:
            return None
        return next((tb for tb in (self.delta_sizes if deltas else self.sizes) if tb >= num_tokens), None)

    def _delta_ids(self, rows: StepRows) -> set[int]:
        """The step's variant ids that are compressed deltas on the GPU."""
        held = self.deltas.slot_of if self.deltas is not None else {}
        return {v for v in rows.variant_ids if v in held}

    def takes(self, rows: StepRows) -> bool:
        """Whether the step of ``rows`` replays here: a bucket holds it and its variant rows (if any)
        are LoRA adapters on the GPU or compressed deltas whose packed configs the CUDA SBMM op takes
        (``DeltaPool.graphable``) in a step of a delta bucket (``delta_sizes``; other kinds run eagerly)."""
        delta_ids = self._delta_ids(rows)
        if self.bucket_for(sum(n for _, n in rows.runs), len(rows.runs), bool(delta_ids)) is None:
            return False
        others = rows.variant_ids - delta_ids
        if others and (self.lora is None or not all(v in self.lora.gpu for v in others)):
            return False
        if not delta_ids:
            return True
        # Captured, the CUDA SBMM op must take every packed config; with capture off (CPU tests) the
        # step's metadata is built on the host and any config runs.
        return self.deltas is not None and (
            not self.capture or self.deltas.graphable(self.deltas.graph_keys(sorted(delta_ids)))
        )

    def run_rows(
        self, step: ForwardBatch, rows: StepRows, device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Runs ``step`` (built on the host; ``takes`` said yes) from its bucket's graph: the plain one,
        or the LoRA one with the rows' adapters in the pool's slot tables. ``device_inputs``: (rows,
        token ids) on the device replacing those input ids (tokens the step before is still sampling).
        Returns float32 logits [len(logits_indices), vocab], a view valid until the next run."""
        delta_ids = self._delta_ids(rows)
        tb = self.bucket_for(step.num_tokens, step.num_seqs, bool(delta_ids))
        if tb is None or len(rows.runs) != step.num_seqs:
            raise ValueError(
                f"MixedGraphs.run_rows: no bucket for {step.num_tokens} tokens in {step.num_seqs} sequences"
            )
        width = step.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"MixedGraphs.run_rows: block tables of {width} pages exceed {self.max_blocks}")
        slots = None
        if self.lora is not None:
            gpu = self.lora.gpu
            ids = [v if v in gpu else 0 for v, _ in rows.runs]
            if any(ids):
                slots = self.lora.assign_rows(ids)
        keys = lane = variant = None
        # With delta rows: the variant id of each token of the bucket and of each of its logits rows (padding 0).
        delta_rows: tuple[list[int], list[int]] | None = None
        if delta_ids:
            assert self.deltas is not None  # ``takes`` said yes
            lane = self.deltas.dense_lane_for(rows.runs, tb)
            lane_key = None if lane is None else self.deltas.key_of[lane]
            # The configs of the deltas on the work tiles (none beside a lone lane delta: no SBMM launch).
            keys = self.deltas.graph_keys(sorted(delta_ids - {lane}))
            tokens = [v for v, n in rows.runs for _ in range(n)]
            logit_ids = list(rows.logit_ids)
            delta_rows = (tokens + [0] * (tb - len(tokens)), logit_ids + [0] * (self._seqs(tb) - len(logit_ids)))
            variant = (tb, slots is not None, keys, lane_key)  # the step's delta graph
            if self.capture and variant not in self.delta_graphs:  # before the step's inputs go in: capture pads
                self._capture_delta(variant)
        seg_start, seg_adapter, has_rows = self._fill(tb, step, slots)
        self._upload(tb, step)
        if device_inputs is not None:
            self._view("input_ids", tb).index_copy_(0, *device_inputs)
        m = int(step.logits_indices.shape[0])
        chunk_only = slots is not None and not has_rows and tb <= CHUNK_LORA_MAX_TOKENS and keys is None
        if self.capture:
            if variant is not None:
                assert self.deltas is not None and delta_rows is not None and keys is not None
                self.deltas.fill_mixed_rows(*delta_rows, keys, lane)
                graph = self.delta_graphs[variant]
            else:
                graphs = self.graphs if slots is None else self.chunk_lora_graphs if chunk_only else self.lora_graphs
                graph = graphs[tb]
            graph.replay()
        else:
            if slots is not None:
                assert self.lora is not None
                self.lora.step.meta = self._lora_meta(tb, seg_start, seg_adapter, rows=not chunk_only)
            try:
                if delta_rows is not None:  # the same token rows and logits rows, as host-built metadata
                    assert self.deltas is not None
                    token_ids, logit_ids = delta_rows
                    self.deltas.begin_step(StepRows([(v, 1) for v in token_ids], logit_ids, decode=True), lane)
                self._forward_into_logits(tb)
            finally:
                if self.lora is not None:
                    self.lora.step.meta = None
                if self.deltas is not None:
                    self.deltas.end_step()
        self.replays += 1
        self.lora_replays += slots is not None
        self.chunk_lora_replays += chunk_only
        self.delta_replays += keys is not None
        self.lane_replays += lane is not None
        return self.logits[:m]


def _offsets(regions: dict[str, int]) -> dict[str, tuple[int, int]]:
    at, start = {}, 0
    for name, size in regions.items():
        at[name] = (start, size)
        start += size
    return at


__all__ = [
    "CHUNK_LORA_MAX_TOKENS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_DELTA_MAX_TOKENS",
    "DELTA_MAX_TOKENS_ENV",
    "DELTA_TOKEN_BUCKETS",
    "MAX_TOKENS_ENV",
    "TOKEN_BUCKETS",
    "MixedGraphs",
    "delta_max_tokens_from_env",
    "max_tokens_from_env",
    "token_buckets_up_to",
]
