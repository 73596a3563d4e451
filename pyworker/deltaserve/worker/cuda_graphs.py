"""CUDA-graph capture and replay of decode steps: one graph per batch-size bucket.

A decode step launches ~1,900 small kernels; eager PyTorch spends far longer issuing them than the
GPU spends running them. Replaying a captured graph issues the whole forward at once.

Layout::

    static inputs (sized for the largest bucket B):      per bucket b <= B:
      input_ids, positions, slot_mapping   [B]  int64      ForwardBatch over rows [0, b)
      seq_lens                             [B]  int32      (max_seq_len = the static maximum,
      query_start_loc = arange(B + 1)      [B+1] int32      max_query_len = 1), its captured graph
      logits_indices  = arange(B)          [B]  int64      and the graph's output logits [b, V]
      block_tables                 [B, max_blocks] int32

    replay(seqs): n rows -> smallest bucket b >= n; rows [0, n) copied in from the step,
                  rows [n, b) are padding: seq_len 0 (attention writes zeros), their K/V go to
                  the scratch slot; replay; return logits[:n]

Everything the captured forward reads lives in those buffers, so a graph stays valid whatever
requests come and go.

With LoRA (``lora``: the executor's ``LoraPool``) every bucket gets a second graph, captured
with the adapted linears active over static metadata: ``row_slot [B]`` int32 (each row's table
slot, -1 for base rows and padding) and ``row_start = arange(B + 1)`` form the MBGMV ``LoraMeta``,
and the pool's slot tables (offsets, ranks, scales) are static too. A decode step with adapter
rows fills its slots' tables (``LoraPool.assign_rows``) and ``row_slot``, then replays that
graph; the MBGMV launch grid depends on the bucket only, so adapters coming and going never
invalidate a graph. Base-only steps keep replaying the plain graphs, which contain no LoRA work. Padding rows write their K/V into ``scratch_slot``, a KV slot the executor
keeps out of the router's pool. Only the Triton attention path is capturable (the torch reference
shapes its tensors by each step's lengths), so graphs need CUDA and the Triton kernels.

With compressed deltas (``deltas``: the executor's ``DeltaPool``, where the CUDA SBMM op runs) a
decode step with delta rows replays a graph captured with the delta-aware modules active over the
pool's static buffers (``DeltaPool.graph_state``: each row's slot, per-config work tiles, the lm_head
delta's tiles), one per (bucket, LoRA rows or not, the step's packed configs). Which configs serve is
known only once deltas are registered: when the first delta of a config is (its ``InspectVariant``),
the executor captures every bucket's graph for that config alone (``capture_config``), so that no
served step stalls on a capture; other combinations (LoRA rows, several configs) are captured the
first time such a step comes. Before a replay the
pool writes the step's rows into those buffers (``fill_graph_rows``); the captured SBMM launches split
K from the step's tile count on the device, as an eager launch would.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from deltaserve.adapters.delta_loads import LAUNCH_LOCK
from deltaserve.kernels.lora import LoraMeta
from deltaserve.model import DecoderLM, ForwardBatch, PagedKVCache
from deltaserve.model.batch import copy_from_host

if TYPE_CHECKING:
    from deltaserve.adapters.delta_pool import DeltaPool
    from deltaserve.adapters.lora_pool import LoraPool
    from deltaserve.adapters.variants import StepRows

log = logging.getLogger(__name__)

#: Decode batch sizes that get a graph (a step runs in the smallest bucket that holds it).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(largest: int, table: tuple[int, ...] = BUCKETS) -> list[int]:
    """The capture sizes of ``table`` below ``largest``, then ``largest`` itself (none if it is 0):
    decode batches of at most ``largest`` rows by default (the mixed graphs pass their token
    buckets)."""
    sizes = [b for b in table if b < largest]
    return sizes + [largest] if largest > 0 else []


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``kv`` for every bucket up to ``max_batch``."""

    def __init__(
        self,
        model: DecoderLM,
        kv: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        scratch_slot: int,
        lora: LoraPool | None = None,
        deltas: DeltaPool | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"DecodeGraphs: max_batch must be >= 1, got {max_batch}")
        device = kv.device
        self.model = model
        """The model whose forward is captured."""
        self.kv = kv
        """The paged KV cache the captured forwards read and write."""
        self.block_size = kv.block_size
        """Tokens per KV page."""
        self.max_batch = max_batch
        """Largest decode batch served from a graph; larger ones run eagerly."""
        self.max_blocks = -(-max_model_len // kv.block_size)
        """Block-table width: enough pages for the longest sequence."""
        self.scratch_slot = scratch_slot
        """KV slot where padding rows write (outside the router's pool)."""
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((max_batch, self.max_blocks), dtype=torch.int32, device=device)
        self.max_seq_len = self.max_blocks * kv.block_size
        """Static bound on every context, as the captured kernels were specialised for it."""
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """Bucket size -> (its graph, the logits tensor the graph writes)."""
        self.lora = lora
        """The adapter pool whose step tables the LoRA graphs read; None: base graphs only."""
        self.row_slot = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        """Static MBGMV metadata: each row's adapter table slot (-1: base row or padding)."""
        self.row_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        """Static MBGMV metadata: row r is segment r."""
        self.lora_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """Bucket size -> (its graph with the adapted linears active, its logits)."""
        self.deltas = deltas
        """The delta pool whose static buffers the delta graphs read; None: steps with deltas run eagerly
        (as do steps whose configs the CUDA SBMM op does not take: ``takes_deltas``)."""
        self.delta_graphs: dict[tuple[int, bool, tuple], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """(bucket, with LoRA rows, the step's packed configs) -> its graph with the deltas active and its
        logits; captured when the config's first delta is registered (``capture_config``: one config, no
        LoRA rows), else at the first step that needs it."""
        self.replays = 0
        """Steps served by a graph so far (tests and logs check graphs are really used)."""
        self.pool = torch.cuda.graph_pool_handle()
        """The memory pool every graph of this runner shares (they never replay at once)."""
        self._capture(buckets_up_to(max_batch))

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b],
            positions=self.positions[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            logits_indices=self.logits_indices[:b],
            max_seq_len=self.max_seq_len,
            max_query_len=1,
        )

    def _capture_forward(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One graph of ``model.forward(batch)`` in the runner's pool, as the adapter steps are set now,
        and its logits. Two eager forwards first compile the Triton kernels and allocate cuBLAS
        workspaces (they run for real: every row must be padding)."""
        for _ in range(2):
            self.model.forward(batch, self.kv)
        torch.cuda.synchronize(self.kv.device)
        graph = torch.cuda.CUDAGraph()
        with LAUNCH_LOCK, torch.cuda.graph(graph, pool=self.pool):  # no delta load launches meanwhile
            logits = self.model.forward(batch, self.kv)
        return graph, logits

    def _capture(self, sizes: list[int]) -> None:
        started = time.monotonic()
        # Every row is padding while capturing: attention reads nothing, K/V go to the scratch slot.
        with torch.inference_mode():
            for b in sorted(sizes, reverse=True):  # largest first: later graphs reuse its pool
                batch = self._batch(b)
                self.graphs[b] = self._capture_forward(batch)
                if self.lora is not None:
                    self.lora.step.meta = self._lora_meta(b)
                    try:
                        self.lora_graphs[b] = self._capture_forward(batch)
                    finally:
                        self.lora.step.meta = None
        torch.cuda.synchronize(self.kv.device)
        log.info(
            "captured %d decode CUDA graphs (batch %s%s) in %.1f s",
            len(sizes),
            ",".join(map(str, sorted(sizes))),
            ", each also with LoRA" if self.lora_graphs else "",
            time.monotonic() - started,
        )

    def _capture_delta(self, b: int, lora: bool, keys: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Captures bucket ``b`` with the deltas of configs ``keys`` active (and LoRA when ``lora``), every
        row padding meanwhile: its warm-up forwards run eagerly and must touch no request's KV pages."""
        assert self.deltas is not None
        started = time.monotonic()
        self.seq_lens[:b].zero_()
        self.slot_mapping[:b].fill_(self.scratch_slot)
        self.row_slot[:b].fill_(-1)
        batch = self._batch(b)
        if lora:
            assert self.lora is not None
            self.lora.step.meta = self._lora_meta(b)
        try:
            with torch.inference_mode(), self.deltas.graph_state(b, self.max_batch, keys):
                captured = self._capture_forward(batch)
        finally:
            if self.lora is not None and lora:
                self.lora.step.meta = None
        log.info(
            "captured the decode graph of batch %d with deltas %s%s in %.2f s",
            b,
            list(keys),
            " and LoRA" if lora else "",
            time.monotonic() - started,
        )
        return captured

    def _lora_meta(self, b: int) -> LoraMeta:
        """MBGMV metadata over the static row buffers for a bucket of ``b`` rows. Its host fields
        only size the launch (decode grids depend on ``b`` alone); the rows' slots are read from
        ``row_slot`` when the graph replays."""
        return LoraMeta(
            seg_start=self.row_start[: b + 1], seg_adapter=self.row_slot[:b],
            seg_start_host=tuple(range(b + 1)), seg_adapter_host=(0,) * b, num_tokens=b,
            max_adapter=0, decode=True,
        )  # fmt: skip

    def takes_deltas(self, delta_ids: list[int]) -> bool:
        """Whether a decode step whose rows use ``delta_ids`` can replay a delta graph: the runner has the
        delta pool and every packed config of the step fits the CUDA SBMM op (``DeltaPool.graphable``)."""
        return self.deltas is not None and self.deltas.graphable(self.deltas.graph_keys(delta_ids))

    def _delta_ids(self, rows: StepRows) -> list[int] | None:
        """Each row's variant id where it is a delta (else 0), or None when no row is one."""
        if self.deltas is None:
            return None
        held = self.deltas.slot_of
        ids = [v if v in held else 0 for v, _ in rows.runs]
        return ids if any(ids) else None

    def takes(self, rows: StepRows) -> bool:
        """Whether the decode step of ``rows`` can replay a graph: a bucket holds it, and its delta rows
        (if any) have configs the CUDA SBMM op takes (``takes_deltas``)."""
        if self.bucket_for(len(rows.runs)) is None:
            return False
        delta_ids = self._delta_ids(rows)
        return delta_ids is None or self.takes_deltas(delta_ids)

    def run_rows(
        self, step: ForwardBatch, rows: StepRows, device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``run`` for a step given as ``StepRows`` (``takes`` said yes): fills the table slots of its
        LoRA rows (``LoraPool.assign_rows``) and picks the delta graph of its delta rows."""
        row_slots = None
        if self.lora is not None:
            gpu = self.lora.gpu
            lora_ids = [v if v in gpu else 0 for v, _ in rows.runs]
            if any(lora_ids):
                row_slots = self.lora.assign_rows(lora_ids)
        return self.run(step, row_slots, device_inputs, self._delta_ids(rows))

    def capture_config(self, key: tuple) -> int:
        """Captures the decode graph of every batch bucket for rows of deltas of packed config ``key`` (no
        LoRA rows) not captured yet: the executor, when the first delta of the config is registered, so
        that no served step stalls on them. Returns how many."""
        missing = [
            (b, False, (key,)) for b in sorted(self.graphs, reverse=True) if (b, False, (key,)) not in self.delta_graphs
        ]
        for variant in missing:
            self.delta_graphs[variant] = self._capture_delta(*variant)
        return len(missing)

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` rows (None: run eagerly)."""
        for b in sorted(self.graphs):
            if b >= n:
                return b
        return None

    def run(
        self,
        step: ForwardBatch,
        row_slots: list[int] | None = None,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
        delta_ids: list[int] | None = None,
    ) -> torch.Tensor:
        """Replays the decode ``step`` (one token per sequence, every row wants logits).

        ``step`` is the step's ``ForwardBatch`` built on the host; its tensors are copied into the
        static buffers. ``row_slots``: each row's adapter table slot (-1: base), already filled by
        ``LoraPool.assign_rows``; given, the LoRA graph replays. ``device_inputs``: (rows, token
        ids) on the device that replace those rows' input ids (tokens the previous step sampled
        and the host does not know yet). ``delta_ids``: each row's variant id where rows use compressed
        deltas (ids the delta pool does not hold count as none); given, the delta graph of the step's
        configs replays (captured first if it is the first such step). Returns float32 logits
        [num_seqs, vocab] (a view valid until the next run).
        """
        n = step.num_seqs
        b = self.bucket_for(n)
        if b is None or step.num_tokens != n or step.logits_indices.numel() != n:
            raise ValueError(f"DecodeGraphs.run: not a decode batch this runner holds ({n} sequences)")
        width = step.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"DecodeGraphs.run: block tables of {width} pages exceed {self.max_blocks}")
        variant = None
        if delta_ids is not None:
            if self.deltas is None or len(delta_ids) != n:
                raise ValueError(f"DecodeGraphs.run: no delta graphs here, or {len(delta_ids)} delta ids for {n} rows")
            keys = self.deltas.graph_keys(delta_ids)
            variant = (b, row_slots is not None, keys)
            if variant not in self.delta_graphs:  # before the step's inputs go in: capture pads every row
                self.delta_graphs[variant] = self._capture_delta(*variant)
        copy_from_host(self.input_ids[:n], step.input_ids)
        if device_inputs is not None:
            self.input_ids.index_copy_(0, *device_inputs)
        copy_from_host(self.positions[:n], step.positions)
        copy_from_host(self.slot_mapping[:n], step.slot_mapping)
        copy_from_host(self.seq_lens[:n], step.seq_lens)
        copy_from_host(self.block_tables[:n, :width], step.block_tables)
        if b > n:
            self.seq_lens[n:b].zero_()
            self.slot_mapping[n:b].fill_(self.scratch_slot)
        graphs = self.graphs
        if row_slots is not None:
            if b not in self.lora_graphs or len(row_slots) != n:
                raise ValueError(f"DecodeGraphs.run: no LoRA graph for {n} rows with {len(row_slots)} slots")
            slots = torch.tensor(row_slots + [-1] * (b - n), dtype=torch.int32)
            copy_from_host(self.row_slot[:b], slots)
            graphs = self.lora_graphs
        if variant is not None:
            assert self.deltas is not None and delta_ids is not None  # a variant means both
            self.deltas.fill_graph_rows(delta_ids, b, variant[2])
            graph, logits = self.delta_graphs[variant]
        else:
            graph, logits = graphs[b]
        graph.replay()
        self.replays += 1
        return logits[:n]
