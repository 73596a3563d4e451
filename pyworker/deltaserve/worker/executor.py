"""The executor: applies one ``StepPlan`` to the worker's state, runs one forward pass, samples.

It owns the model, the paged KV cache and per-request state; it never decides policy (the router
does). One step::

    StepPlan ─ validate (whole plan, nothing mutated) ──> PlanError on any bad reference
        │
        ├─ drop released ─ adapter_ops in order (AdapterPool) ─ register new_requests (full state)
        │      ─ append running.new_block_ids
        ├─ ForwardBatch.build: every scheduled request computes tokens
        │      [num_computed, num_computed + num_scheduled_tokens); it wants logits only when that
        │      reaches the end of its known tokens (a partial prefill chunk does not)
        ├─ DecoderLM.forward(batch, kv) -> logits [rows wanting logits, V]
        ├─ Sampler.sample -> token ids (+ logprobs); each sampled token is appended to its request,
        │      so next step's ``num_scheduled_tokens = 1`` computes it
        └─> StepOutput (token_id None for partial prefill chunks), timing.forward_us

Per-request state machine (worker side)::

    (absent) ──NewRequest──> held ──RunningRequest*──> held ──released──> (absent)
                               └── a failed step (PlanError) also drops the step's requests ──┘

KV sizing (``kv_cache_bytes == 0``, "auto"): on CPU a fixed 256 MiB (RAM is not the scarce
resource there and the CPU path is for tests and demos). On CUDA, as in vLLM:
``gpu_memory_utilization × total − (memory in use after loading the weights) − (activation peak
of one profiling forward over max_num_batched_tokens tokens)``; the first two come from
``torch.cuda.mem_get_info`` (so other processes on the GPU count), the last from
``max_memory_allocated`` around the profiling run.

LoRA adapters (``adapters/pool.py``): the router registers an adapter by ``InspectAdapter``
(``inspect_adapter``: validation + footprint, no state change) and then moves it between tiers
with the ``AdapterOp``s of its plans (``to_host`` / ``to_gpu`` / ``drop_gpu`` / ``drop_host``,
applied in order after ``released`` and before the requests). On the GPU an adapter lives in pages
of the KV pool, the same page ids as KV pages; the router accounts for both. Every block linear is
a ``LoraLinear`` from start-up (``attach_lora``; ``--max-lora-rank 0`` turns LoRA off). A
NewRequest names its adapter by ``adapter_id`` (0 = base alone); the request keeps it until
released, and every step that schedules it needs the adapter GPU-resident after the step's ops.
Before each forward ``AdapterPool.begin_step`` maps the step's adapters to table slots and builds
the kernels' metadata (rows in ForwardBatch order: scheduled new requests, then running ones); a
step whose requests are all base sets nothing and pays nothing. Op errors found by validation are
a PlanError (nothing applied); a ``to_host`` load that fails in the background (the directory
vanished since inspection) surfaces when ``to_gpu`` needs it as ``AdapterLoadError``, which the
worker loop reports as a fatal WorkerError (the router restarts the worker).

Compressed deltas (``adapters/delta_pool.py``, DeltaZip): the same ids, ops and inspection, told
apart by the directory (``manifest.json`` of ``deltaserve compress``, not ``adapter_config.json``).
A delta's ``to_gpu`` carries no pages: it takes one of ``--max-deltas`` slots (the router keeps at
most that many deltas resident; the auto KV budget on CUDA leaves room for that many 4-bit 2:4
deltas). Every block linear, the embedding, the norms and lm_head are delta-aware from start-up
(``attach_deltas``, after ``attach_lora``): base once for the batch, then each token's delta.

CUDA graphs: each decode bucket has a plain graph (no LoRA work, for base-only steps) and, with
LoRA on, a graph captured with the adapted linears active over static metadata (``DecodeGraphs``);
a decode step with adapter rows fills its adapters' table slots (``AdapterPool.assign_rows``) and
replays the latter. Decode steps with delta rows replay a graph of the step's delta configs (and
LoRA rows, if any), captured the first time such a step comes, where the CUDA SBMM op runs (else
they run eagerly). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve import wire
from deltaserve.adapters.delta_layers import attach_deltas
from deltaserve.adapters.delta_pool import DeltaPool, delta_gpu_bytes, is_delta_dir
from deltaserve.adapters.lora_layers import attach_lora
from deltaserve.adapters.pinned_arena import PinnedArena, slack_for
from deltaserve.adapters.pool import OPS, AdapterPool
from deltaserve.kernels import common as kernel_common
from deltaserve.model.arch import ModelConfig
from deltaserve.model.batch import ForwardBatch, to_device
from deltaserve.model.kv_cache import PagedKVCache
from deltaserve.model.loader import load_model

from .config import WorkerConfig
from .cuda_graphs import DecodeGraphs
from .sampler import LaunchedSample, Sampler

log = logging.getLogger("deltaserve.worker")

#: Auto KV budget on CPU.
CPU_KV_BYTES = 256 << 20
#: Most sequences the profiling run puts in one batch (a typical scheduler max_num_seqs).
PROFILE_MAX_SEQS = 256


class PlanError(ValueError):
    """A StepPlan refers to something the worker does not hold or cannot do.

    Recoverable: the executor's state is untouched; ``req_ids`` are the offending requests.
    """

    def __init__(self, message: str, req_ids: list[int]) -> None:
        super().__init__(message)
        #: The requests the problems were found in (empty when the plan as a whole is bad).
        self.req_ids = req_ids


@dataclass
class RequestState:
    """What the worker keeps for one request between steps."""

    #: Router-assigned id.
    req_id: int
    #: Every known token: prompt, then outputs (the last one possibly not yet computed).
    token_ids: list[int]
    #: Prompt tokens at the front of ``token_ids``; output i is ``token_ids[num_prompt_tokens + i]``.
    num_prompt_tokens: int
    #: Leading tokens whose K/V is in the cache.
    num_computed: int
    #: KV pages in position order.
    block_table: list[int]
    #: How to sample this request's tokens.
    sampling: wire.SamplingParams
    #: The LoRA adapter whose delta this request's tokens get (GPU-resident whenever the request is
    #: scheduled), 0 for the base alone.
    adapter_id: int = 0
    #: Tokens sampled by a launched step that ``finish`` has not appended yet (0 or 1): they are
    #: known to exist, so the next step may compute them (from the device) before they reach us.
    pending: int = 0


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``Executor.finish`` completes it."""

    #: The plan's step id.
    step_id: int
    #: Every scheduled request and its token count, in batch order.
    scheduled: list[tuple[RequestState, int]]
    #: The requests that sample a token, in the sampled tensor's row order.
    samplers: list[RequestState]
    #: When the launch began (``timing.forward_us`` runs from here to the tokens being on the host).
    started: float
    #: The queued sampling (None when no request samples).
    sampled: LaunchedSample | None = None
    #: req_id -> its row in ``sampled``.
    sample_row: dict[int, int] = field(default_factory=dict)
    #: Recorded after the step's work on CUDA; None on CPU (work there is done when launch returns).
    done: torch.cuda.Event | None = None

    def is_done(self) -> bool:
        """Whether the device has finished the step (``finish`` would not wait)."""
        return self.done is None or self.done.query()


def resolve_device(name: str) -> torch.device:
    """``cpu`` / ``cuda`` / ``cuda:N`` -> a concrete torch.device (``cuda`` gets its index)."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: CUDA is not available in this process")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"--device {name}: only {torch.cuda.device_count()} CUDA devices")
        device = torch.device("cuda", index)
    return device


def resolve_dtype(name: str, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """``auto`` = float32 on CPU; on CUDA the checkpoint's half type, else bfloat16."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if cfg.torch_dtype == "float16" else torch.bfloat16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Executor:
    """Model + KV cache + per-request state; turns StepPlans into StepOutputs."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_bytes: int = 0,
        gpu_memory_utilization: float = 0.90,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
        cuda_graph_max_batch: int = 0,
        max_lora_rank: int = 256,
        max_loras_per_step: int = 256,
        max_deltas: int = 3,
        host_arena_bytes: int = 0,
    ) -> None:
        started = time.monotonic()
        self.model_dir = Path(model_dir)
        """Where the weights came from (logged, reported)."""
        self.device = resolve_device(device)
        """Where the model, KV cache and logits live."""
        self.config = ModelConfig.from_model_dir(self.model_dir)
        """The model's resolved shape (vocab, layers, heads...)."""
        self.dtype = resolve_dtype(dtype, self.device, self.config)
        """Compute and KV dtype."""
        self.block_size = block_size
        """Tokens per KV page; must equal the router's accounting unit."""
        self.max_num_batched_tokens = max_num_batched_tokens
        """Most tokens one step computes (sizes the activation reserve)."""
        self.model = load_model(self.model_dir, self.device, self.dtype)
        """The decoder: ``forward(ForwardBatch, PagedKVCache) -> float32 logits``."""
        self.load_seconds = time.monotonic() - started
        """Wall time to load the weights."""
        self.sampler = Sampler(self.device, seed)
        """Token sampling with the worker-global generator."""
        self.delta_reserve_bytes = max_deltas * delta_gpu_bytes(self.config, self.dtype)
        """GPU bytes the auto KV budget leaves for ``max_deltas`` 4-bit 2:4 deltas (their slots)."""
        budget = self._kv_budget(kv_cache_bytes, gpu_memory_utilization)
        self.kv = PagedKVCache.for_budget(self.config, block_size, budget, self.dtype, self.device)
        """The paged KV pool; the router allocates its pages."""
        self.bytes_per_block = PagedKVCache.bytes_per_block(
            self.config.num_layers, block_size, self.config.num_kv_heads, self.config.head_dim, self.dtype
        )
        """Bytes of one page across all layers (reported in Hello)."""
        self.graphs: DecodeGraphs | None = None
        """Captured decode steps, when enabled (CUDA with the Triton kernels)."""
        use_graphs = (
            cuda_graph_max_batch > 0
            and self.device.type == "cuda"
            and kernel_common.use_triton_for(self.device)
            and self.kv.num_blocks > 1
        )
        self.num_blocks = self.kv.num_blocks - (1 if use_graphs else 0)
        """Pages the router may allocate; with graphs the last page is the padding rows' scratch."""
        self.host_arena: PinnedArena | None = None
        """Host memory both host tiers' copies are carved from (``host_arena_bytes`` plus room against
        fragmentation, pinned once here on CUDA); None when ``host_arena_bytes`` is 0."""
        if host_arena_bytes > 0 and (max_lora_rank > 0 or max_deltas > 0):
            self.host_arena = PinnedArena(host_arena_bytes + slack_for(host_arena_bytes),
                                          pin=self.device.type == "cuda")
        self.adapters: AdapterPool | None = None
        """LoRA adapters' tiers and step tables; None when LoRA is off (``max_lora_rank`` 0)."""
        if max_lora_rank > 0:
            self.adapters = AdapterPool(
                self.config, self.kv, max_lora_rank=max_lora_rank, max_loras_per_step=max_loras_per_step,
                max_tokens=max(max_num_batched_tokens, cuda_graph_max_batch), arena=self.host_arena,
            )
            attach_lora(self.model, self.adapters.step, self.adapters.weights)
        self.deltas: DeltaPool | None = None
        """Compressed deltas' tiers and GPU slots; None when delta serving is off (``max_deltas`` 0)."""
        if max_deltas > 0:
            self.deltas = DeltaPool(self.model, self.model_dir, max_deltas=max_deltas, device=self.device,
                                    dtype=self.dtype, arena=self.host_arena)
            attach_deltas(self.model, self.deltas.step)
        limits = [self.config.max_position_embeddings, self.num_blocks * block_size]
        if max_model_len is not None:
            limits.append(max_model_len)
        self.max_model_len = min(limits)
        """Longest prompt + output a request may reach on this worker."""
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv, cuda_graph_max_batch, self.max_model_len,
                scratch_slot=self.num_blocks * block_size, lora=self.adapters,
                deltas=self.deltas,
            )
        self.requests: dict[int, RequestState] = {}
        """Requests the worker holds, by req_id."""
        log.info(
            "loaded %s (%s, %d layers, vocab %d) on %s as %s in %.1f s; KV pool %d blocks x %d tokens "
            "(%.1f MiB, %d bytes/block); max_model_len %d",
            self.model_dir, self.config.architecture, self.config.num_layers, self.config.vocab_size,
            self.device, dtype_name(self.dtype), self.load_seconds, self.kv.num_blocks, block_size,
            self.kv.num_blocks * self.bytes_per_block / (1 << 20), self.bytes_per_block, self.max_model_len,
        )

    @classmethod
    def from_config(cls, cfg: WorkerConfig) -> "Executor":
        """Builds the executor a ``python -m deltaserve.worker`` command line describes."""
        return cls(
            cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            block_size=cfg.block_size,
            kv_cache_bytes=cfg.kv_cache_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            seed=cfg.seed,
            cuda_graph_max_batch=cfg.cuda_graph_max_batch,
            max_lora_rank=cfg.max_lora_rank,
            max_loras_per_step=cfg.max_loras_per_step,
            max_deltas=cfg.max_deltas,
            host_arena_bytes=cfg.host_arena_bytes,
        )

    def inspect_adapter(self, path: str) -> wire.AdapterInfo:
        """The answer to ``InspectAdapter`` (``inspect_id`` left 0 for the caller to set); no state change."""
        if is_delta_dir(path):
            if self.deltas is None:
                return wire.AdapterInfo(error=f"delta {path}: delta serving is off on this worker (--max-deltas 0)",
                                        kind="delta")
            return self.deltas.inspect(path)
        if self.adapters is None:
            return wire.AdapterInfo(error=f"LoRA adapter {path}: LoRA is off on this worker (--max-lora-rank 0)",
                                    kind="lora")
        return self.adapters.inspect(path)

    @property
    def adapter_host_bytes(self) -> int:
        """Bytes of variant copies (LoRA and delta) in host memory (finished loads measured, running ones
        expected)."""
        return (0 if self.adapters is None else self.adapters.host_bytes) + (
            0 if self.deltas is None else self.deltas.host_bytes
        )

    def _step_output(self, step_id: int, outputs: list[wire.RequestOutput], timing: wire.StepTiming) -> wire.StepOutput:
        """A ``StepOutput`` with the host tier's state: its bytes, and the variants (LoRA and delta)
        whose host reads finished since the previous output."""
        ready = [] if self.adapters is None else self.adapters.host.take_finished()
        if self.deltas is not None:
            ready += self.deltas.host.take_finished()
        return wire.StepOutput(step_id=step_id, outputs=outputs, timing=timing,
                               adapter_host_bytes=self.adapter_host_bytes, host_ready=ready)

    def _is_delta(self, variant_id: int) -> bool:
        """Whether ``variant_id`` is a delta this worker holds (host or GPU); else LoRA or unknown."""
        return self.deltas is not None and (variant_id in self.deltas.host or variant_id in self.deltas.slot_of)

    # ------------------------------------------------------------------ handshake

    def hello(self, schema_hash: str) -> wire.Hello:
        """The first frame: what the router needs to know about the model and the KV pool."""
        cfg = self.config
        return wire.Hello(
            schema_hash=schema_hash,
            pid=os.getpid(),
            model=wire.ModelInfo(
                architecture=cfg.architecture,
                vocab_size=cfg.vocab_size,
                max_model_len=self.max_model_len,
                num_layers=cfg.num_layers,
                hidden_size=cfg.hidden_size,
                eos_token_ids=list(cfg.eos_token_ids),
                dtype=dtype_name(self.dtype),
                device=str(self.device),
                num_params=sum(p.numel() for p in self.model.parameters()),
            ),
            kv=wire.KvCapacity(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                bytes_per_block=self.bytes_per_block,
            ),
        )

    # ------------------------------------------------------------------ KV sizing

    def _kv_budget(self, kv_cache_bytes: int, gpu_memory_utilization: float) -> int:
        """Bytes for the KV pool: the explicit setting, or auto (see the module docstring)."""
        if kv_cache_bytes > 0:
            return kv_cache_bytes
        if self.device.type != "cuda":
            return CPU_KV_BYTES
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_after_weights = total - free
        activation = self._profile_activation_bytes()
        deltas = self.delta_reserve_bytes
        budget = int(gpu_memory_utilization * total) - used_after_weights - activation - deltas
        log.info(
            "auto KV budget: %.2f x %.0f MiB total - %.0f MiB in use after weights - %.0f MiB activations "
            "(profiled, %d tokens) - %.0f MiB delta slots = %.0f MiB",
            gpu_memory_utilization, total / (1 << 20), used_after_weights / (1 << 20), activation / (1 << 20),
            self.max_num_batched_tokens, deltas / (1 << 20), budget / (1 << 20),
        )
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: {gpu_memory_utilization} x {total} bytes - "
                f"{used_after_weights} in use - {activation} activations - {deltas} delta slots = {budget}; raise "
                "--gpu-memory-utilization, lower --max-num-batched-tokens or --max-deltas, or set --kv-cache-bytes"
            )
        return budget

    @torch.inference_mode()
    def _profile_activation_bytes(self) -> int:
        """Peak extra CUDA memory of the worst steps we expect, measured by running them.

        Two shapes, max of both: one long prefill (attention over the whole context), and
        ``max_num_batched_tokens`` spread over up to PROFILE_MAX_SEQS sequences that all want
        logits and logprobs (the logits and sampler buffers). The scratch KV is subtracted.
        """
        cfg = self.config
        tokens = self.max_num_batched_tokens
        long_len = min(tokens, cfg.max_position_embeddings)
        num_seqs = min(PROFILE_MAX_SEQS, tokens)
        shapes = [[long_len] * max(1, tokens // long_len), [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]]
        peak = 0
        for lengths in shapes:
            blocks_per_seq = [-(-n // self.block_size) for n in lengths]
            scratch = PagedKVCache(
                cfg.num_layers, sum(blocks_per_seq), self.block_size, cfg.num_kv_heads, cfg.head_dim,
                self.dtype, self.device,
            )
            seqs, first = [], 0
            for n, nb in zip(lengths, blocks_per_seq):
                seqs.append(([0] * n, 0, list(range(first, first + nb)), True))
                first += nb
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            batch = ForwardBatch.build(seqs, self.block_size, self.device)
            logits = self.model.forward(batch, scratch)
            params = [wire.SamplingParams(temperature=1.0, top_p=0.9, top_k=0, seed=None, logprobs=20)] * len(seqs)
            self.sampler.sample(logits, params, [0] * len(seqs))
            torch.cuda.synchronize(self.device)
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - before)
            del batch, logits, scratch
        torch.cuda.empty_cache()
        return peak

    # ------------------------------------------------------------------ steps

    def step(self, plan: wire.StepPlan) -> wire.StepOutput:
        """Applies ``plan``, runs one forward and returns what every scheduled request produced.

        Raises PlanError (state untouched) when the plan is inconsistent with the worker's state.
        The same as ``finish(launch(plan))`` with no step in flight.
        """
        return self.finish(self.launch(plan, None))

    def launch(self, plan: wire.StepPlan, in_flight: LaunchedStep | None) -> LaunchedStep:
        """Applies ``plan`` and queues its forward and sampling on the device; waits for nothing.

        ``in_flight`` is the step launched before and not yet finished (None when there is none).
        A running request whose last sampled token is still in flight there (``pending``) computes
        it: its input row is copied on the device from that step's sampled tensor. Finish steps
        in launch order. Raises PlanError (state untouched) when the plan is inconsistent with
        the worker's state.
        """
        if in_flight is None and any(state.pending for state in self.requests.values()):
            raise RuntimeError("launch: requests wait for sampled tokens but no step in flight was given")
        self._validate(plan)
        for req_id in plan.released:
            self.requests.pop(req_id, None)
        for op in plan.adapter_ops:  # AdapterLoadError here is fatal (module docstring)
            if (is_delta_dir(op.path) if op.op == "to_host" else self._is_delta(op.adapter_id)):
                assert self.deltas is not None  # _validate refuses delta ops when deltas are off
                self.deltas.apply(op)
            else:
                assert self.adapters is not None  # _validate refuses LoRA ops when LoRA is off
                self.adapters.apply(op)
        for new in plan.new_requests:
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                num_computed=new.num_computed_tokens,
                block_table=list(new.block_ids),
                sampling=new.sampling,
                adapter_id=new.adapter_id,
            )
        for run in plan.running:
            self.requests[run.req_id].block_table.extend(run.new_block_ids)

        scheduled: list[tuple[RequestState, int]] = [
            (self.requests[n.req_id], n.num_scheduled_tokens) for n in plan.new_requests if n.num_scheduled_tokens > 0
        ] + [(self.requests[r.req_id], r.num_scheduled_tokens) for r in plan.running]
        launched = LaunchedStep(step_id=plan.step_id, scheduled=scheduled, samplers=[], started=time.perf_counter())
        if not scheduled:
            return launched

        seqs = []
        samplers = launched.samplers
        # Input rows that are tokens still being sampled by ``in_flight``: (row, its sampled row).
        patch_rows: list[int] = []
        patch_from: list[int] = []
        row = 0
        for state, n in scheduled:
            end = state.num_computed + n
            known = len(state.token_ids)
            wants_logits = end == known + state.pending
            tokens = state.token_ids[state.num_computed:end]
            if end > known:  # the pending token: a placeholder here, filled on the device below
                assert in_flight is not None and end == known + 1 == state.num_computed + 1
                patch_rows.append(row)
                patch_from.append(in_flight.sample_row[state.req_id])
                tokens = [0]
            seqs.append((tokens, state.num_computed, state.block_table, wants_logits))
            if wants_logits:
                samplers.append(state)
            row += n
        # Each request's variant: a LoRA adapter (AdapterPool), a delta (DeltaPool) or 0 (base).
        is_delta = {state.adapter_id: self._is_delta(state.adapter_id) for state, _ in scheduled}
        lora_ids = [0 if is_delta[state.adapter_id] else state.adapter_id for state, _ in scheduled]
        with_adapters = any(lora_ids)
        with_deltas = any(is_delta.values())
        pending_inputs = None
        if patch_rows:
            assert in_flight is not None and in_flight.sampled is not None
            pending_inputs = (to_device(patch_rows, torch.long, self.device),
                              in_flight.sampled.token_ids.index_select(0, to_device(patch_from, torch.long, self.device)))
        with torch.inference_mode():
            decode = len(samplers) == len(seqs) and all(n == 1 for _, n in scheduled)
            delta_ids = [s.adapter_id if is_delta[s.adapter_id] else 0 for s, _ in scheduled] if with_deltas else None
            if (decode and self.graphs is not None and self.graphs.bucket_for(len(seqs)) is not None
                    and (delta_ids is None or self.graphs.takes_deltas(delta_ids))):  # fmt: skip
                row_slots = None
                if with_adapters:
                    assert self.adapters is not None  # _validate admits adapter ids only when resident
                    row_slots = self.adapters.assign_rows(lora_ids)
                logits = self.graphs.run(ForwardBatch.build(seqs, self.block_size, "cpu"), row_slots, pending_inputs,
                                         delta_ids)
            else:
                batch = ForwardBatch.build(seqs, self.block_size, self.device)
                if pending_inputs is not None:
                    batch.input_ids.index_copy_(0, *pending_inputs)
                if with_adapters:
                    assert self.adapters is not None  # _validate admits adapter ids only when resident
                    self.adapters.begin_step([(a, n) for a, (_, n) in zip(lora_ids, scheduled)], decode)
                if with_deltas:
                    assert self.deltas is not None  # _validate admits delta ids only when resident
                    self.deltas.begin_step([(state.adapter_id, n) for state, n in scheduled],
                                           [s.adapter_id for s in samplers], decode)
                try:
                    logits = self.model.forward(batch, self.kv)
                finally:
                    if with_adapters:
                        self.adapters.end_step()
                    if with_deltas:
                        self.deltas.end_step()
            if samplers:
                launched.sampled = self.sampler.launch(
                    logits,
                    [s.sampling for s in samplers],
                    [len(s.token_ids) + s.pending - s.num_prompt_tokens for s in samplers],
                )
        # The step's tokens are computed (or queued to be): the next step continues from there.
        for state, n in scheduled:
            state.num_computed += n
        for j, state in enumerate(samplers):
            state.pending += 1
            launched.sample_row[state.req_id] = j
        if self.device.type == "cuda":
            launched.done = torch.cuda.Event()
            launched.done.record()
        return launched

    def finish(self, launched: LaunchedStep) -> wire.StepOutput:
        """Waits for ``launched``'s sampled tokens, appends them to their requests, and returns the
        step's output (``token_id`` None for partial prefill chunks)."""
        timing = wire.StepTiming(gap_us=0, forward_us=0, total_us=0)
        if not launched.scheduled:
            return self._step_output(launched.step_id, [], timing)
        sampled = launched.sampled.result() if launched.sampled is not None else None
        timing.forward_us = int((time.perf_counter() - launched.started) * 1e6)
        outputs = []
        for state, _ in launched.scheduled:
            j = launched.sample_row.get(state.req_id)
            if j is None or sampled is None:  # a partial prefill chunk: nothing to sample yet
                outputs.append(wire.RequestOutput(req_id=state.req_id, token_id=None, logprob=None, top_logprobs=[]))
                continue
            token = sampled.token_ids[j]
            state.token_ids.append(token)
            state.pending -= 1
            outputs.append(
                wire.RequestOutput(
                    req_id=state.req_id,
                    token_id=token,
                    logprob=sampled.logprobs[j],
                    top_logprobs=[wire.TokenLogprob(token_id=t, logprob=lp) for t, lp in sampled.top_logprobs[j]],
                )
            )
        return self._step_output(launched.step_id, outputs, timing)

    def drop_step_requests(self, plan: wire.StepPlan) -> list[int]:
        """After a failed step: forgets every request the plan released or scheduled.

        The router is told these requests failed (``WorkerError.req_ids``), so it will not send them
        as running again; a retry comes back as a NewRequest. Returns the scheduled ones' ids.
        """
        failed = [n.req_id for n in plan.new_requests] + [r.req_id for r in plan.running]
        for req_id in list(plan.released) + failed:
            self.requests.pop(req_id, None)
        return list(dict.fromkeys(failed))

    def _validate(self, plan: wire.StepPlan) -> None:
        """Checks every reference in ``plan`` against the state; raises PlanError listing all problems."""
        problems: list[str] = []
        bad: list[int] = []

        def fail(req_id: int, what: str) -> None:
            problems.append(f"request {req_id}: {what}")
            if req_id not in bad:
                bad.append(req_id)

        vocab, num_blocks, bs = self.config.vocab_size, self.num_blocks, self.block_size

        def check_blocks(req_id: int, blocks: list[int], needed_tokens: int, have: int) -> None:
            out_of_pool = [b for b in blocks if not 0 <= b < num_blocks]
            if out_of_pool:
                fail(req_id, f"block ids {out_of_pool[:4]} outside the pool of {num_blocks} blocks")
            if (have + len(blocks)) * bs < needed_tokens:
                fail(req_id, f"{have + len(blocks)} blocks of {bs} tokens cannot hold {needed_tokens} tokens")

        released = set(plan.released)
        held_after_release = set(self.requests) - released
        on_gpu, page_owner, delta_gpu = self._validate_adapter_ops(plan, problems)
        resident = ", ".join(map(str, sorted(on_gpu))) or "none"

        def check_adapter(req_id: int, adapter_id: int) -> None:
            if adapter_id != 0 and adapter_id not in on_gpu:
                fail(req_id, f"adapter_id {adapter_id} is not on the GPU after this step's adapter ops "
                     f"(resident: {resident}; 0 = base model)")

        def check_not_adapter_pages(req_id: int, blocks: list[int]) -> None:
            taken = [b for b in blocks if b in page_owner]
            if taken:
                fail(req_id, f"KV block ids {taken[:4]} hold adapter {page_owner[taken[0]]}'s weights")

        new_ids: set[int] = set()
        for new in plan.new_requests:
            rid = new.req_id
            if rid in held_after_release or rid in new_ids:
                fail(rid, "sent as new but the worker already holds it (release it first)")
            new_ids.add(rid)
            n_tokens = len(new.token_ids)
            if n_tokens == 0:
                fail(rid, "has no tokens")
            bad_tokens = [t for t in new.token_ids if not 0 <= t < vocab]
            if bad_tokens:
                fail(rid, f"token ids {bad_tokens[:4]} outside the vocab size {vocab}")
            if n_tokens > self.max_model_len:
                fail(rid, f"{n_tokens} tokens exceed max_model_len {self.max_model_len}")
            if new.num_prompt_tokens > n_tokens:
                fail(rid, f"num_prompt_tokens {new.num_prompt_tokens} > {n_tokens} known tokens")
            end = new.num_computed_tokens + new.num_scheduled_tokens
            if end > n_tokens:
                fail(rid, f"schedules tokens up to {end} but only {n_tokens} are known")
            check_blocks(rid, list(new.block_ids), end, 0)
            if new.sampling.temperature < 0 or not 0.0 <= new.sampling.top_p <= 1.0:
                fail(rid, f"bad sampling params {new.sampling}")
            if new.num_scheduled_tokens > 0:
                check_adapter(rid, new.adapter_id)
            check_not_adapter_pages(rid, list(new.block_ids))

        running_ids: set[int] = set()
        for run in plan.running:
            rid = run.req_id
            state = self.requests.get(rid)
            if state is None or rid in released or rid in new_ids:
                fail(rid, "scheduled as running but the worker does not hold it")
                continue
            if rid in running_ids:
                fail(rid, "scheduled twice in one step")
            running_ids.add(rid)
            if run.num_scheduled_tokens < 1:
                fail(rid, "running with num_scheduled_tokens 0")
            end = state.num_computed + run.num_scheduled_tokens
            known = len(state.token_ids) + state.pending
            if end > known:
                fail(rid, f"schedules tokens up to {end} but only {known} are known")
            check_blocks(rid, list(run.new_block_ids), end, len(state.block_table))
            check_adapter(rid, state.adapter_id)
            check_not_adapter_pages(rid, list(run.new_block_ids))

        step_adapters = {n.adapter_id for n in plan.new_requests if n.num_scheduled_tokens > 0} | {
            self.requests[r.req_id].adapter_id for r in plan.running if r.req_id in self.requests
        }
        step_adapters = {a for a in step_adapters if a != 0 and a not in delta_gpu}
        if self.adapters is not None and len(step_adapters) > self.adapters.max_slots:
            problems.append(f"{len(step_adapters)} distinct adapters in one step exceed --max-loras-per-step "
                            f"{self.adapters.max_slots}")

        placed = [(i, op) for i, op in enumerate(plan.adapter_ops) if op.op == "to_gpu"]
        if placed:  # pages an adapter moves into must hold no request's KV after this step
            kv_pages = {b for rid in held_after_release for b in self.requests[rid].block_table}
            kv_pages.update(b for new in plan.new_requests for b in new.block_ids)
            kv_pages.update(b for run in plan.running for b in run.new_block_ids)
            for i, op in placed:
                clash = [b for b in op.block_ids if b in kv_pages]
                if clash:
                    problems.append(f"adapter op {i} (to_gpu adapter {op.adapter_id}): block ids {clash[:4]} "
                                    "hold request KV")

        if problems:
            raise PlanError(f"step {plan.step_id}: bad plan: " + "; ".join(problems), bad)

    def _validate_adapter_ops(
        self, plan: wire.StepPlan, problems: list[str]
    ) -> tuple[set[int], dict[int, int], set[int]]:
        """Replays ``plan.adapter_ops`` on a copy of the tier state, appending what is wrong.

        An op's variant is a delta when its ``to_host`` path is a delta directory (``is_delta_dir``)
        or the worker already holds that id as a delta; else a LoRA adapter. Returns the variants on
        the GPU after the ops (both kinds), the page -> LoRA adapter map they leave, and the deltas
        among them.
        """
        pool, deltas = self.adapters, self.deltas
        on_host = set() if pool is None else set(pool.host)
        on_gpu = set() if pool is None else set(pool.gpu)
        page_owner = {} if pool is None else dict(pool.page_owner)
        delta_host = set() if deltas is None else set(deltas.host)
        delta_gpu = set() if deltas is None else set(deltas.slot_of)
        for i, op in enumerate(plan.adapter_ops):
            aid = op.adapter_id

            def bad(what: str) -> None:
                problems.append(f"adapter op {i} ({op.op} adapter {aid}): {what}")

            if aid == 0:
                bad("adapter id 0 is the base model")
                continue
            delta = is_delta_dir(op.path) if op.op == "to_host" and op.path else aid in delta_host | delta_gpu
            if delta and deltas is None:
                bad("delta serving is off on this worker (--max-deltas 0)")
                continue
            if not delta and pool is None:
                bad("LoRA is off on this worker (--max-lora-rank 0)")
                continue
            # One tier state machine for both kinds; only a to_gpu's placement differs.
            host, gpu = (delta_host, delta_gpu) if delta else (on_host, on_gpu)
            other, other_kind = (on_host | on_gpu, "a LoRA adapter") if delta else (delta_host | delta_gpu, "a delta")
            if aid in other:
                bad(f"the id is {other_kind} on this worker")
            elif op.op == "to_host":
                if aid in host:
                    bad("already in host memory (drop_host first)")
                elif not op.path:
                    bad("no path")
                else:
                    host.add(aid)
            elif op.op == "to_gpu":
                if aid not in host:
                    bad("not in host memory (a to_host must come first)")
                elif aid in gpu:
                    bad("already on the GPU (drop_gpu first)")
                else:
                    problem = (self._delta_slot_problem(op, len(gpu)) if delta
                               else self._lora_pages_problem(op, page_owner))  # fmt: skip
                    if problem:
                        bad(problem)
                    else:
                        gpu.add(aid)
                        page_owner.update((b, aid) for b in op.block_ids)
            elif op.op == "drop_gpu":
                if aid not in gpu:
                    bad("not on the GPU")
                else:
                    gpu.discard(aid)
                    page_owner = {b: a for b, a in page_owner.items() if a != aid}
            elif op.op == "drop_host":
                if aid not in host:
                    bad("not in host memory")
                else:
                    host.discard(aid)
            else:
                bad(f"unknown op {op.op!r} (expected one of {', '.join(OPS)})")
        return on_gpu | delta_gpu, page_owner, delta_gpu

    def _delta_slot_problem(self, op: wire.AdapterOp, resident: int) -> str | None:
        """Why a delta's ``to_gpu`` cannot be placed with ``resident`` deltas on the GPU, or None."""
        assert self.deltas is not None
        if op.block_ids:
            return "a delta takes a delta slot, not pool pages: block_ids must be empty"
        if resident >= self.deltas.max_deltas:
            return f"all {self.deltas.max_deltas} delta slots (--max-deltas) are taken"
        return None

    def _lora_pages_problem(self, op: wire.AdapterOp, page_owner: dict[int, int]) -> str | None:
        """Why a LoRA adapter's ``to_gpu`` cannot go on ``op.block_ids`` given the pages adapters hold, or None."""
        assert self.adapters is not None
        blocks = list(op.block_ids)
        if not blocks:
            return "no block ids"
        outside = [b for b in blocks if not 0 <= b < self.num_blocks]
        repeated = sorted({b for b in blocks if blocks.count(b) > 1})
        taken = [b for b in blocks if b in page_owner]
        need = self.adapters.num_blocks_of(op.adapter_id)
        if outside:
            return f"block ids {outside[:4]} outside the pool of {self.num_blocks} blocks"
        if repeated:
            return f"block ids {repeated[:4]} repeated"
        if taken:
            return f"block ids {taken[:4]} hold adapter {page_owner[taken[0]]}"
        if need is not None and need != len(blocks):
            return f"{len(blocks)} block ids, the adapter needs {need}"
        return None
