"""The executor: applies one ``StepPlan`` to the worker's state, runs one forward pass, samples.

It wires the worker's parts and owns nothing the router decides (policy is the router's). One step::

    StepPlan ─ check_plan (plan_check.py: the whole plan, nothing mutated) ──> PlanError on any bad reference
        │
        ├─ release (requests.py) ─ adapter_ops in order, each to the pool of its ``kind`` (variants.py)
        │      ─ admit new requests (full state) ─ append running.new_block_ids
        ├─ ForwardRunner.launch (runner.py): rows, graph or eager forward, sampling queued
        └─ finish: the sampled tokens ──> StepOutput (token_id None for partial prefill chunks),
               timing.forward_us, timing.floor_us (the step's roofline floor, ``step_floor.py``), the
               variant pools' host tier (adapter_host_bytes, host_ready) and the deltas copied to the
               GPU beside the steps (gpu_ready: ``adapters/delta_loads.py``)

Its parts: ``requests.py`` (per-request state and the plan's diffs), ``plan_check.py`` (validation,
with the replay of the variant ops), ``memory.py`` (the KV budget), ``runner.py`` (forward and
sampling) and one ``VariantPool`` per variant kind that is on (``adapters/variants.py``): the LoRA
pool (``--max-lora-rank`` > 0; every block linear is a ``LoraLinear`` from start-up) and the delta
pool (``--max-deltas`` > 0; block linears, embedding, norms and lm_head are delta-aware from
start-up). A NewRequest names its variant by ``adapter_id`` (0 = base alone); the request keeps it
until released, and every step that schedules it needs it GPU-resident after the step's ops. A host
read that fails in the background (the directory vanished or changed since inspection) surfaces at
the ``to_gpu`` that needs it as ``AdapterLoadError``: the variant is quarantined (``quarantine.py``),
its requests leave this and every later step, the next StepOutput reports it, and the worker serves
on (the router fails that variant's requests only).

CPU LoRA helpers (``cpu_lora_helpers`` > 0, ``helpers/``): the host tier's copies live in a shared
arena the helper processes map, and a cold adapter's prefill may run with its LoRA on the helpers
while its pages load (``helpers/assist.py``: ``land`` at the start of each launch, ``takes`` per
ToGpu, ``start_landing`` after the ops).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from deltaserve import wire
from deltaserve.adapters.block_speculation import BlockSpeculation, ColdPrefill, SpeculationStats
from deltaserve.adapters.delta_layers import attach_deltas
from deltaserve.adapters.delta_pool import DeltaPool
from deltaserve.adapters.delta_slots import reserve_bytes
from deltaserve.adapters.host_tier import AdapterLoadError
from deltaserve.adapters.lora_layers import attach_lora
from deltaserve.adapters.lora_pool import LoraPool
from deltaserve.adapters.pinned_arena import PinnedArena, slack_for
from deltaserve.adapters.variants import VariantKind, VariantPool, refused_as_off
from deltaserve.helpers.assist import CpuAssist
from deltaserve.helpers.model import AssistStats
from deltaserve.helpers.shm import SharedSegment
from deltaserve.kernels import common as kernel_common
from deltaserve.model.arch import ModelConfig
from deltaserve.model.kv_cache import PagedKVCache
from deltaserve.model.loader import load_model

from . import requests as request_diffs
from .config import WorkerConfig
from .cuda_graphs import DecodeGraphs
from .eager_warmup import warm_eager_kernels
from .guidance import GrammarGate
from .memory import kv_budget
from .mixed_graphs import MixedGraphs, max_tokens_from_env
from .plan_check import PlanError, PlanLimits, check_plan
from .quarantine import Quarantine
from .requests import RequestState
from .runner import ForwardRunner, LaunchedStep
from .sampler import Sampler
from .step_floor import ModelCosts, measure_roofline, scheduled_floor

log = logging.getLogger("deltaserve.worker")

CAPTURE_AT_REGISTRATION_ENV = "DELTASERVE_DELTA_GRAPHS_AT_REGISTRATION"
"""Which delta graphs the first delta of a packed config captures when it is registered
(``Executor._capture_delta_config``): ``decode,mixed`` (the default), one of them, or ``off`` (every
delta graph is captured at the first step that needs it)."""


def graphs_at_registration() -> frozenset[str]:
    """``CAPTURE_AT_REGISTRATION_ENV`` as the graph kinds it names (empty: off); ValueError names a bad value."""
    text = (os.environ.get(CAPTURE_AT_REGISTRATION_ENV) or "decode,mixed").replace(" ", "").lower()
    kinds = frozenset(text.split(",")) - {""}
    if kinds == {"off"}:
        return frozenset()
    if not kinds or not kinds <= {"decode", "mixed"}:
        raise ValueError(f"{CAPTURE_AT_REGISTRATION_ENV}={text!r}: want decode, mixed, decode,mixed or off")
    return kinds


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
    """Model + KV cache + variant pools + per-request state; turns StepPlans into StepOutputs."""

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
        cpu_lora_helpers: int = 0,
        cpu_lora_policy: str = "adaptive",
        cuda_graph_max_tokens: int | None = None,
    ) -> None:
        started = time.monotonic()
        self.model_dir = Path(model_dir)
        """Where the weights came from (logged, reported)."""
        self.device = resolve_device(device)
        """Where the model, KV cache and logits live."""
        if self.device.type == "cuda":
            # The process's current device is its own: Triton launches, CUDA graphs, streams and
            # events use the current device, so a worker on cuda:1 left on cuda:0 handed Triton
            # pointers it could not access (found on two H200s: `--devices 0,1` did not start).
            torch.cuda.set_device(self.device)
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
        self.model_costs = ModelCosts.of_model(self.model, self.config, self.dtype)
        """What a step of the base model reads and computes (``step_floor.py``; before any variant wrapper)."""
        self.roofline = measure_roofline(self.device, self.dtype)
        """The device's copy bandwidth and matmul peak, measured once (before the KV pool takes the memory)."""
        self.sampler = Sampler(self.device, seed)
        """Token sampling with the worker-global generator."""
        self.delta_reserve_bytes = reserve_bytes(self.model, self.dtype, max_deltas)
        """GPU bytes the auto KV budget leaves for the ``max_deltas`` delta slots: all the delta pool
        allocates, whatever packed configs its deltas have (``adapters/delta_slots.py``)."""
        budget = kv_budget(
            self.model,
            self.sampler,
            device=self.device,
            dtype=self.dtype,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            reserve_bytes=self.delta_reserve_bytes,
        )
        self.kv = PagedKVCache.for_budget(self.config, block_size, budget, self.dtype, self.device)
        """The paged KV pool; the router allocates its pages."""
        self.bytes_per_block = PagedKVCache.bytes_per_block(
            self.config.num_layers, block_size, self.config.num_kv_heads, self.config.head_dim, self.dtype
        )
        """Bytes of one page across all layers (reported in Hello)."""
        if self.device.type == "cuda" and kernel_common.use_triton_for(self.device):
            warm_eager_kernels(self.model, device=self.device, dtype=self.dtype, block_size=block_size)
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
        helpers = cpu_lora_helpers if max_lora_rank > 0 else 0
        shared_arena: SharedSegment | None = None
        """With CPU LoRA helpers the arena is shared memory they map read-only (always on then)."""
        if helpers > 0:
            shared_arena = SharedSegment(host_arena_bytes + slack_for(host_arena_bytes), "host-arena")
        if shared_arena is not None or (host_arena_bytes > 0 and (max_lora_rank > 0 or max_deltas > 0)):
            self.host_arena = PinnedArena(
                host_arena_bytes + slack_for(host_arena_bytes),
                pin=self.device.type == "cuda",
                buf=None if shared_arena is None else shared_arena.tensor(),
            )
        self.pools: dict[VariantKind, VariantPool] = {}
        """The variant pools by kind: one per kind that is on (the seam, ``adapters/variants.py``)."""
        self.lora_pool: LoraPool | None = None
        """The LoRA pool; None when LoRA is off (``max_lora_rank`` 0)."""
        if max_lora_rank > 0:
            self.lora_pool = LoraPool(
                self.config,
                self.kv,
                max_lora_rank=max_lora_rank,
                max_loras_per_step=max_loras_per_step,
                max_tokens=max(max_num_batched_tokens, cuda_graph_max_batch),
                arena=self.host_arena,
                router_blocks=self.num_blocks,
            )
            attach_lora(self.model, self.lora_pool.step, self.lora_pool.weights)
            self.pools[VariantKind.LORA] = self.lora_pool
        self.delta_pool: DeltaPool | None = None
        """The delta pool; None when delta serving is off (``max_deltas`` 0)."""
        self.speculation: BlockSpeculation | None = None
        """Surrogate blocks for cold deltas' prefills (``adapters/block_speculation.py``); None when off."""
        if max_deltas > 0:
            self.delta_pool = DeltaPool(
                self.model,
                self.model_dir,
                max_deltas=max_deltas,
                device=self.device,
                dtype=self.dtype,
                arena=self.host_arena,
            )
            attach_deltas(self.model, self.delta_pool.step)
            self.pools[VariantKind.DELTA] = self.delta_pool
            self.speculation = BlockSpeculation.from_env(self.delta_pool)
        limits = [self.config.max_position_embeddings, self.num_blocks * block_size]
        if max_model_len is not None:
            limits.append(max_model_len)
        self.max_model_len = min(limits)
        """Longest prompt + output a request may reach on this worker."""
        self.graphs_at_registration = graphs_at_registration()
        """Which delta graphs a new packed config captures when its first delta is registered."""
        self.graphs: DecodeGraphs | None = None
        """Captured decode steps, when enabled (CUDA with the Triton kernels)."""
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv,
                cuda_graph_max_batch,
                self.max_model_len,
                scratch_slot=self.num_blocks * block_size,
                lora=self.lora_pool,
                deltas=self.delta_pool,
            )
        self.guidance = GrammarGate(self.model_dir, self.config.vocab_size, self.config.eos_token_ids)
        """Structured output: compiles grammars at admission, fills the constrained rows' masks."""
        self.runner = ForwardRunner(self.model, self.kv, self.sampler, self.pools, self.graphs, block_size)
        """Queues each step's forward and sampling."""
        # Prefill and mixed steps by token bucket, up to ``cuda_graph_max_tokens`` tokens (None: the env
        # DELTASERVE_CUDA_GRAPH_MAX_TOKENS, default 2048; 0: eager), never more than a step computes.
        if cuda_graph_max_tokens is None:
            cuda_graph_max_tokens = max_tokens_from_env()
        graph_tokens = min(cuda_graph_max_tokens, max_num_batched_tokens)
        if self.graphs is not None and graph_tokens > 0:
            self.runner.mixed = MixedGraphs(
                self.model,
                self.kv,
                graph_tokens,
                cuda_graph_max_batch,
                self.max_model_len,
                scratch_slot=self.num_blocks * block_size,
                lora=self.lora_pool,
                pool=self.graphs.pool,
                deltas=self.delta_pool,
            )
        self.runner.guidance = self.guidance
        self.cpu_assist: CpuAssist | None = None
        """CPU-assisted cold prefills (``helpers/assist.py``); None when the helpers are off."""
        if shared_arena is not None and self.lora_pool is not None:
            self.cpu_assist = CpuAssist(
                self.lora_pool,
                self.config,
                shared_arena,
                helpers=helpers,
                policy=cpu_lora_policy,
                max_rows=max_num_batched_tokens,
            )
            self.runner.assist = self.cpu_assist
        self.limits = PlanLimits(self.config.vocab_size, self.num_blocks, block_size, self.max_model_len)
        """What plans are checked against."""
        self.requests: dict[int, RequestState] = {}
        """Requests the worker holds, by req_id."""
        self.quarantine = Quarantine()
        """Variants whose files failed after registration: their requests leave every step."""
        log.info(
            "loaded %s (%s, %d layers, vocab %d) on %s as %s in %.1f s; KV pool %d blocks x %d tokens "
            "(%.1f MiB, %d bytes/block); max_model_len %d",
            self.model_dir,
            self.config.architecture,
            self.config.num_layers,
            self.config.vocab_size,
            self.device,
            dtype_name(self.dtype),
            self.load_seconds,
            self.kv.num_blocks,
            block_size,
            self.kv.num_blocks * self.bytes_per_block / (1 << 20),
            self.bytes_per_block,
            self.max_model_len,
        )

    @classmethod
    def from_config(cls, cfg: WorkerConfig) -> Executor:
        """Builds the executor the router's ``WorkerConfig`` describes."""
        return cls(
            Path(cfg.model_dir),
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
            cpu_lora_helpers=cfg.cpu_lora_helpers,
            cpu_lora_policy=cfg.cpu_lora_policy,
        )

    # ------------------------------------------------------------------ variants

    def inspect_variant(self, path: str, kind: VariantKind = VariantKind.LORA) -> wire.VariantInfo:
        """The answer to ``InspectVariant`` (``inspect_id`` left 0 for the caller to set): ``path`` validated
        as a variant of ``kind`` (the router tells the kind; its default is the wire's). Nothing a request
        sees changes; the first valid delta of a packed config captures that config's graphs on CUDA
        (``_capture_delta_config``)."""
        pool = self.pools.get(kind)
        if kind == VariantKind.LORA and self.cpu_assist is not None:
            self.cpu_assist.pool.start()  # lazily, at the first adapter: ready before its first request
        info = refused_as_off(kind, path) if pool is None else pool.inspect(path)
        if info.error is None and kind == VariantKind.DELTA:
            self._capture_delta_config(path)
        return info

    def _capture_delta_config(self, path: str) -> None:
        """Captures the delta graphs of the packed config of the delta at ``path`` (valid) when it is the
        first of its config: every decode bucket's and every delta bucket's mixed-step graph (with its
        dense lanes) for that config alone, now, at its registration, instead of in the first served
        steps that need them (each capture stalls the whole batch for 0.1-0.3 s on an H200). The pool
        makes the config's slot views first, as its first ``to_gpu`` would have."""
        deltas = self.delta_pool
        if self.graphs is None or deltas is None:
            return
        which = self.graphs_at_registration
        if not which:
            return
        key = deltas.config_key(path)
        if key in deltas.step.weights or not deltas.prepare_config(key):
            return  # seen before (captured then, or its steps run eagerly), or the CUDA op does not take it
        started = time.monotonic()
        try:
            n = self.graphs.capture_config(key) if "decode" in which else 0
            if self.runner.mixed is not None and "mixed" in which:
                n += self.runner.mixed.capture_config(key)
        except RuntimeError as e:  # out of memory too; the steps capture what is missing, as before
            log.warning("capturing the delta graphs of config %s at its registration failed (%s): "
                        "its steps capture them when they come", key, e)  # fmt: skip
            return
        log.info("captured %d delta graphs of config %s at its first registration in %.1f s", n, key,
                 time.monotonic() - started)  # fmt: skip

    @property
    def variant_host_bytes(self) -> int:
        """Bytes of variant copies (every kind) in host memory (finished loads measured, running ones
        expected)."""
        return sum(pool.host_bytes for pool in self.pools.values())

    def _step_output(self, step_id: int, outputs: list[wire.RequestOutput], timing: wire.StepTiming) -> wire.StepOutput:
        """A ``StepOutput`` with the host tier's state: its bytes, and the variants (every kind) whose
        host reads finished since the previous output; and the deltas whose copies to the GPU, beside
        the steps, finished since (``gpu_ready``)."""
        ready = [aid for pool in self.pools.values() for aid in pool.take_finished()]
        gpu_ready = [aid for pool in self.pools.values() for aid in pool.take_gpu_ready()]
        assist = self.take_assist_stats()
        spec = self.speculation.take_stats() if self.speculation is not None else SpeculationStats()
        return wire.StepOutput(
            failed_variants=self.quarantine.take_reports(),
            refused_requests=self.guidance.take_refusals(),
            step_id=step_id,
            outputs=outputs,
            timing=timing,
            adapter_host_bytes=self.variant_host_bytes,
            host_ready=ready,
            gpu_ready=gpu_ready,
            cpu_assisted_prefills=assist.assisted,
            cpu_assist_fallbacks=assist.fallbacks,
            cpu_assist_declined=sum(assist.declined.values()),
            speculated_prefills=spec.speculated,
            speculation_accepted=spec.accepted,
            speculation_recomputed_layers=spec.recomputed_layers,
        )

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
            delta_graph_tokens=self.runner.mixed.delta_graph_tokens if self.runner.mixed is not None else 0,
        )

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
        assist = self.cpu_assist
        if assist is not None:  # last step's deferred placements: the plan check sees them placed
            for op, error in assist.land():  # a failed one is its variant's failure (helpers/assist.py)
                self._quarantine(op, error)
        self.quarantine.lift_reloaded(plan)
        plan = self.quarantine.filter_plan(plan, self.requests)
        plan, grammars = self.guidance.admit_plan(plan, self.requests)  # refuses grammars that fail
        check_plan(plan, self.requests, self.pools, self.limits)
        request_diffs.release(self.requests, plan)
        cold = assist.cold_prefills(plan) if assist is not None else {}
        gate = self.speculation.gate_for(plan) if self.speculation is not None else None
        failed = False
        for op in plan.adapter_ops:
            if op.adapter_id in self.quarantine:
                continue  # failed earlier in this plan: its later ops and requests are dropped
            if gate is not None and gate.defers(op):
                continue  # placed by the gate during the forward (block_speculation.py)
            if op.adapter_id in cold and assist is not None and assist.takes(op, cold[op.adapter_id]):
                continue  # deferred: the helpers compute its rows this step
            try:
                self.pools[op.kind].apply(op)
            except AdapterLoadError as e:  # the variant's failure, not the worker's (module docstring)
                self._quarantine(op, e)
                failed = True
        if failed:
            plan = self.quarantine.filter_plan(plan, self.requests)
        if assist is not None:
            assist.start_landing()
        scheduled = request_diffs.admit(self.requests, plan)
        used = {state.variant_id for state, _ in scheduled}
        for pool in self.pools.values():  # a delta admitted with its to_gpu: its copies, still running
            pool.wait_gpu(used)
        for req_id, grammar in grammars.items():
            if req_id in self.requests:
                self.requests[req_id].grammar = grammar
        floor = scheduled_floor(self.model_costs, self.roofline, scheduled, self.pools)
        launched = self._run(plan.step_id, scheduled, in_flight, gate)
        launched.floor_us = floor.floor_us
        return launched

    def _run(
        self, step_id: int, scheduled: list[tuple[RequestState, int]], in_flight: LaunchedStep | None,
        gate: ColdPrefill | None,
    ) -> LaunchedStep:  # fmt: skip
        """The runner's launch, through ``gate`` when a cold delta's prefill speculates: an eager forward
        (no decode or mixed graph replayed or captured), the gate placing the delta mid-forward; a read
        failing there quarantines the delta and its requests leave the step (their rows ran on the
        surrogate)."""
        if gate is None:
            return self.runner.launch(step_id, scheduled, in_flight)
        self.model.layer_gate = gate
        try:
            launched = self.runner.launch(step_id, scheduled, in_flight, eager=True)  # the gate must run
        finally:
            self.model.layer_gate = None
        failure = gate.close()
        if failure is not None:
            self._quarantine(gate.op, failure)
            gone = {s.req_id for s, _ in launched.scheduled if s.variant_id == gate.delta_id}
            launched.scheduled = [(s, n) for s, n in launched.scheduled if s.req_id not in gone]
            for req_id in gone:
                self.requests.pop(req_id, None)
            self.quarantine.dropped.update(gone)  # until the router releases them (quarantine.py)
        return launched

    def finish(self, launched: LaunchedStep) -> wire.StepOutput:
        """Waits for ``launched``'s sampled tokens, appends them to their requests, and returns the
        step's output (``token_id`` None for partial prefill chunks)."""
        timing = wire.StepTiming(gap_us=0, forward_us=0, total_us=0, floor_us=launched.floor_us, busy_us=0)
        if not launched.scheduled:
            return self._step_output(launched.step_id, [], timing)
        outputs, timing.forward_us = self.runner.finish(launched)
        if self.cpu_assist is not None:
            self.cpu_assist.check_guard()  # a device wait past its bound: these rows are not known good
        return self._step_output(launched.step_id, outputs, timing)

    def _quarantine(self, op: wire.VariantOp, error: AdapterLoadError) -> None:
        """Takes the variant of the op that failed out of service (``quarantine.py``); its host
        entry goes (nothing was placed: a failed ``to_gpu`` raises before placing)."""
        self.quarantine.add(op.adapter_id, "its files could not be loaded", error)
        pool = self.pools[op.kind]
        if op.adapter_id in pool.host_ids():
            pool.apply(wire.VariantOp(op.adapter_id, wire.TierOp.DROP_HOST, "", [], kind=op.kind))

    def drop_step_requests(self, plan: wire.StepPlan) -> list[int]:
        """After a failed step: forgets every request the plan released or scheduled.

        The router is told these requests failed (``WorkerError.req_ids``), so it will not send them
        as running again; a retry comes back as a NewRequest. Returns the scheduled ones' ids.
        """
        return request_diffs.drop_step_requests(self.requests, plan)

    def take_assist_stats(self) -> AssistStats:
        """The CPU assist decisions since the last call (all zero when the helpers are off)."""
        return self.cpu_assist.take_stats() if self.cpu_assist is not None else AssistStats()

    def close(self) -> None:
        """Stops the CPU LoRA helpers (they also die with the process)."""
        if self.cpu_assist is not None:
            self.cpu_assist.close()


__all__ = ["Executor", "LaunchedStep", "PlanError", "RequestState", "dtype_name", "resolve_device", "resolve_dtype"]
