"""``CpuAssist``: a cold adapter's prefill starts at once, its LoRA computed by the helpers while its
pages load (CaraServe §4.1). The worker side; the executor, the runner and ``LoraLinear`` call it.

One step (``Executor.launch``)::

    land()               the placements deferred last step are finished (the switch-over boundary)
    cold_prefills(plan)  adapters of new requests that prefill > 1 token this step
    takes(op, ...)       for a LoRA ToGpu of such an adapter X: decide (model.py); if assisted, X's
                         placement is deferred (CPU: a thread copies the pages; CUDA: a side stream)
    start_landing()      the deferred placements start, overlapping this step's forward
    runner: begin(rows)  X's rows count as base rows for the pools; the step's compacted rows, the
                         helper chunks, R and S frames to the helpers; step.assist = self
    LoraLinear(x):       send(layer, module, x) before the base matmul: x's assisted rows into the
                         data segment, one job per helper; add(pending, out) after it: wait, then
                         out[rows] = dtype(float32(out[rows]) + result)
    runner: end()
    executor: finish     check_guard(): a device wait that passed its bound fails the worker

Two invocations of the helpers (``invocation``): "signal", the sync-free one (``signalled.py``: the
copy of x and the SEQ words queued on the stream, the stream waits on the DONE words, a watcher
thread answers for helpers that fail or stall), the default on CUDA when ``csrc/cpu_lora_signal.cu``
is built; and "host", host-synchronised (a blocking copy of x, the J doorbell, the launching
thread waits on the helpers' replies and computes a failed helper's rows itself), the default on
CPU workers and the benchmark's baseline on CUDA (``set_invocation``).

Switch-over at the next step: X's pages are only used after ``land`` at the start of the next
launch, so this step never reads a half-copied page (no per-layer check of the copy's progress is
needed) and the next step, prefill chunk or decode, runs on the normal path. Decode never uses the
helpers. A helper that fails, dies or misses its deadline (``pool.wait``) is killed; its rows of
that job and of the rest of the step are computed by the worker itself from the same host copy
(the same math, ``compute.py``), so the output stays correct; it is restarted at the next cold
prefill. The fallback is counted.

A deferred placement that fails (``AdapterLoadError``: the variant's files) is the variant's
failure, not the worker's: ``land`` returns it and the executor quarantines the variant as it does
any load failure (its requests end with the failure's message; the others go on). A host read that
failed before the decision declines the assist ("host_failed") and the normal ToGpu reports it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import wire
from ..adapters.host_tier import AdapterLoadError
from ..adapters.lora_pool import LoraPool
from ..adapters.variants import StepRows, VariantKind
from ..model.arch import ModelConfig
from ..model.decoder import linear_slots
from . import protocol as p
from . import signal_op
from .compute import RAW_DTYPES, adapter_weights, module_delta, to_f32
from .model import ALWAYS_WAIT_READY_S, POLICIES, AssistModel, AssistStats, measure_load_bytes_per_ms
from .pool import HelperPool
from .shm import SharedSegment
from .signalled import DEVICE_GUARD_S, SignalledJob, Watcher

log = logging.getLogger("deltaserve.worker")

MIN_JOB_TIMEOUT_S = 0.5
"""A job's deadline is at least this (a busy host may not run a helper for a while); past it the
worker computes the rows itself and restarts the helper."""
INVOCATIONS = ("auto", "signal", "host")
"""How the helpers are invoked (module docstring); "auto": "signal" on CUDA with the op built, else "host"."""


@dataclass
class Cold:
    """One assisted adapter in this step."""

    entry: p.AdapterEntry
    """Its host copy as the helpers read it."""
    helpers: list[int]
    """The helpers its rows are split across."""
    requests: int
    """Its requests prefilled this step (the count ``assisted`` adds)."""
    adapted: set[tuple[int, int]]
    """(layer, module) where it adapts some slice: only those get jobs."""


@dataclass
class StepAssist:
    """The current step's assisted rows (``begin``)."""

    idx: torch.Tensor
    """Batch rows of the assisted adapters, grouped by adapter (compacted order), on the device."""
    rows: int
    chunks: list[tuple[int, int, int, int]]
    """(helper, lo, hi, adapter) over the compacted rows."""
    dead: set[int] = field(default_factory=set)
    """Helpers that failed this step: their chunks are the worker's from then on."""
    fell_back: set[int] = field(default_factory=set)
    """Adapters with a chunk the worker computed."""


@dataclass
class Pending:
    """A module's jobs sent before its base matmul (``send``), finished by ``add``."""

    layer: int
    module: int
    width: int
    jobs: list[tuple[int, int, int, int]]
    seqs: dict[int, int]
    local: list[tuple[int, int, int, int]]
    sent_at: float
    seq: int = 0
    """The signalled job's number (0 on the host-synchronised path)."""


def dtype_code(dtype: torch.dtype) -> int:
    return p.DTYPE_CODES[str(dtype).removeprefix("torch.")]


def model_spec(cfg: ModelConfig, lora: LoraPool) -> tuple[p.ModelSpec, dict[str, int]]:
    """The modules as the helpers see them, and module path -> its index."""
    slots = linear_slots(cfg)
    modules: dict[str, list[tuple[int, int, int]]] = {}
    ins: dict[str, int] = {}
    for i, proj in enumerate(lora.order):
        s = slots[proj]
        modules.setdefault(s.module, []).append((i, s.start, s.size))
        ins[s.module] = lora.features[proj][0]
    paths = list(modules)
    spec = p.ModelSpec(tuple((ins[m], tuple(modules[m])) for m in paths), cfg.hidden_size)
    return spec, {m: i for i, m in enumerate(paths)}


class CpuAssist:
    """The worker side of CPU-assisted cold starts (module docstring)."""

    def __init__(
        self,
        lora: LoraPool,
        cfg: ModelConfig,
        arena: SharedSegment,
        *,
        helpers: int,
        policy: str,
        max_rows: int,
        invocation: str = "auto",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--cpu-lora-policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.lora = lora
        self.device = lora.device
        self.policy = policy
        self.spec, self.module_index = model_spec(cfg, lora)
        widths = [max(c + n for _, c, n in sl) for _, sl in self.spec.modules]
        layout = p.DataLayout(max(1, max_rows), max(i for i, _ in self.spec.modules), max(widths))
        self.widths = widths
        self.layout = layout
        self.arena = arena
        self.arena_np = arena.array(np.uint8)
        self.arena_base = arena.tensor().data_ptr()
        self.pool = HelperPool(helpers, arena, self.spec, layout)
        self.data_t = self.pool.data.tensor()
        self.model = AssistModel(measure_load_bytes_per_ms(self.device))
        self.stats = AssistStats()
        """Decisions since the last ``take_stats`` (each StepOutput reports them)."""
        self.totals = AssistStats()
        """Decisions since start-up."""
        self.cold: dict[int, Cold] = {}
        """Adapters assisted this step, by id (``takes``)."""
        self.deferred: list[wire.VariantOp] = []
        """Their ToGpu ops, started by ``start_landing``."""
        self._landing: threading.Thread | None = None
        self._landing_error: BaseException | None = None
        self._landing_event: torch.cuda.Event | None = None
        self._side: torch.cuda.Stream | None = None
        self._landing_failures: list[tuple[wire.VariantOp, AdapterLoadError]] = []
        self.step: StepAssist | None = None
        self.steps = 0
        """Steps with assisted rows so far (the watcher's step numbers)."""
        self.words_t = self.pool.control.tensor().view(torch.int64).view(helpers, p.JOB_WORDS)
        """The control words as a tensor (what ``signal_op`` writes and waits on)."""
        self.watcher = Watcher(
            self.pool.words, self.pool.data.array(np.uint8), self.arena_np, self.spec, layout.out_offset
        )
        self.failed = torch.zeros(1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        """Set by a device wait that passed its bound (``check_guard``); pinned, so the device writes it."""
        self._registered = False
        self.sync_free = False
        """True: the signalled (sync-free) invocation; False: host-synchronised."""
        self.set_invocation(invocation)

    def set_invocation(self, invocation: str) -> None:
        """Picks the invocation (``INVOCATIONS``); "signal" on CUDA needs the built op (else "host")."""
        if invocation not in INVOCATIONS:
            raise ValueError(f"cpu assist invocation {invocation!r}: expected one of {', '.join(INVOCATIONS)}")
        cuda = self.device.type == "cuda"
        if invocation == "host" or (invocation == "auto" and not cuda):
            self.sync_free = False
            return
        if cuda and not self._register():
            if invocation == "signal":
                raise RuntimeError("cpu assist: the signalled invocation needs csrc/cpu_lora_signal.cu built")
            self.sync_free = False
            return
        self.sync_free = True

    def _register(self) -> bool:
        """Maps the control and data segments for the device (once); False without the built op."""
        if self._registered:
            return True
        if signal_op.library() is None:
            return False
        try:
            data = self.pool.data.tensor()
            signal_op.register_mapped(self.pool.control.tensor())
            signal_op.register_mapped(data)
        except RuntimeError as e:
            log.warning("cpu assist: host-synchronised invocation (%s)", e)
            return False
        if not data.is_pinned():
            log.warning("cpu assist: host-synchronised invocation (the data segment is not seen as pinned)")
            return False
        self._registered = True
        return True

    # ------------------------------------------------------------------ plan

    def land(self) -> list[tuple[wire.VariantOp, AdapterLoadError]]:
        """Finishes last step's deferred placements: from here on they are the normal path's.
        Returns the placements that failed with the variant's ``AdapterLoadError`` (the caller
        quarantines those variants); any other failure raises."""
        if self._landing is not None:
            self._landing.join()
            self._landing = None
        if self._landing_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._landing_event)
            self._landing_event = None
        self.cold.clear()
        if self._landing_error is not None:
            err, self._landing_error = self._landing_error, None
            raise err
        failures, self._landing_failures = self._landing_failures, []
        return failures

    def check_guard(self) -> None:
        """Raises when a device wait passed its bound (``signalled.py``): the step's rows are not
        known to be right, so the worker fails instead of answering with them."""
        if int(self.failed[0]) != 0:
            raise RuntimeError(
                f"cpu assist: a device wait for the helpers passed its {DEVICE_GUARD_S:.0f} s bound "
                "and no watcher answered for them"
            )

    def cold_prefills(self, plan: wire.StepPlan) -> dict[int, list[int]]:
        """Adapter id -> the token counts of its new requests this step, for the adapters whose ToGpu
        is in the plan (a one-token prefill marks its adapter as not assistable: decode path)."""
        ops = plan.adapter_ops
        if not any(op.kind == VariantKind.LORA and wire.TierOp(op.op) is wire.TierOp.TO_HOST for op in ops) and not any(
            op.kind == VariantKind.LORA and wire.TierOp(op.op) is wire.TierOp.TO_GPU for op in ops
        ):
            return {}
        for h in self.watcher.take_dead():  # killed by the watcher: cleaned up, restarted below
            self.pool.kill(h, "the watcher stopped it")
        self.pool.start()  # lazily: the first adapter load; ready after their hellos
        if self.policy == "always":
            self.pool.wait_ready(ALWAYS_WAIT_READY_S)
        else:
            self.pool.poll()
        to_gpu = {
            op.adapter_id for op in ops if op.kind == VariantKind.LORA and wire.TierOp(op.op) is wire.TierOp.TO_GPU
        }
        cold: dict[int, list[int]] = {}
        for n in plan.new_requests:
            if n.adapter_id in to_gpu and n.num_scheduled_tokens > 0:
                cold.setdefault(n.adapter_id, []).append(n.num_scheduled_tokens)
        return cold

    def takes(self, op: wire.VariantOp, tokens: list[int]) -> bool:
        """Decides whether adapter ``op.adapter_id``'s prefill is assisted; if so, defers its ToGpu
        (returns True: the caller does not apply it)."""
        if op.kind != VariantKind.LORA or wire.TierOp(op.op) is not wire.TierOp.TO_GPU:
            return False
        aid = op.adapter_id
        if min(tokens) < 2:
            self.stats.decline("decode", len(tokens))
            return False
        try:
            copy = self.lora.wait_host(aid)  # what the ToGpu would wait for anyway
        except AdapterLoadError:
            self.stats.decline("host_failed", len(tokens))
            return False  # the normal ToGpu raises it again and the variant is quarantined
        packed = copy.packed
        offset = packed.data_ptr() - self.arena_base
        if not 0 <= offset < self.arena.size:
            self.stats.decline("not_shared", len(tokens))
            return False
        free = [i for i in self.pool.ready() if all(i not in c.helpers for c in self.cold.values())]
        self.model.macs_per_ms = self.pool.profile_macs_per_ms() or 0.0
        layout = copy.layout
        entry = p.AdapterEntry(
            aid, offset, dtype_code(packed.dtype), packed.shape[0], layout.packed_elems,
            {s.index: (s.packed_start, s.rank, s.in_dim, s.out_dim) for s in layout.slices},
            copy.rank.tolist(), copy.scale.tolist(),
        )  # fmt: skip
        macs = sum(
            r * (entry.slices[s][2] + entry.slices[s][3])
            for ranks in entry.rank for s, r in enumerate(ranks) if r
        )  # fmt: skip
        adapted = {
            (layer, m)
            for layer, ranks in enumerate(entry.rank)
            for m, (_, sl) in enumerate(self.spec.modules)
            if any(ranks[s] for s, _, _ in sl)
        }
        total = sum(tokens)
        k = min(self.model.helpers_for(total, macs), len(free))
        if k == 0:
            self.stats.decline("no_helper", len(tokens))
            return False
        if self.policy == "adaptive" and self.model.cpu_ms(total, k, macs, len(adapted)) >= self.model.load_ms(
            packed.nbytes
        ):
            self.stats.decline("slower", len(tokens))
            return False
        self.cold[aid] = Cold(entry, free[:k], len(tokens), adapted)
        self.deferred.append(op)
        return True

    def start_landing(self) -> None:
        """Starts the deferred placements, which overlap this step's forward."""
        ops, self.deferred = self.deferred, []
        if not ops:
            return
        if self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_stream(main)  # pages a step in flight still reads are copied after it
            with torch.cuda.stream(self._side):
                for op in ops:
                    try:
                        self.lora.apply(op)
                    except AdapterLoadError as e:  # the variant's failure: land() reports it
                        self._landing_failures.append((op, e))
            self._landing_event = torch.cuda.Event()
            self._landing_event.record(self._side)
            return

        def place() -> None:
            try:
                for op in ops:
                    try:
                        self.lora.apply(op)
                    except AdapterLoadError as e:  # the variant's failure: land() reports it
                        self._landing_failures.append((op, e))
            except BaseException as e:  # noqa: BLE001 - raised by land() on the main thread
                self._landing_error = e

        self._landing = threading.Thread(target=place, name="cpu-lora-landing", daemon=True)
        self._landing.start()

    # ------------------------------------------------------------------ step

    def rows_for_pools(self, rows: StepRows) -> StepRows:
        """``rows`` with the assisted adapters' rows as base rows (the pools do not hold them yet)."""
        if not self.cold:
            return rows
        c = self.cold
        return StepRows(
            [(0 if v in c else v, n) for v, n in rows.runs], [0 if v in c else v for v in rows.logit_ids], rows.decode
        )

    def begin(self, rows: StepRows) -> StepRows:
        """Sets up the step's assisted rows and tells the helpers; returns the rows for the pools."""
        if not self.cold:
            return rows
        starts: dict[int, list[int]] = {a: [] for a in self.cold}
        row = 0
        for v, n in rows.runs:
            if v in starts:
                starts[v].extend(range(row, row + n))
            row += n
        order: list[int] = []
        chunks: list[tuple[int, int, int, int]] = []
        for aid, batch_rows in starts.items():
            lo, cold = len(order), self.cold[aid]
            order.extend(batch_rows)
            n, k = len(batch_rows), len(cold.helpers)
            for j, h in enumerate(cold.helpers):
                a, b = lo + n * j // k, lo + n * (j + 1) // k
                if a < b:
                    chunks.append((h, a, b, aid))
        if len(order) > self.layout.max_rows:
            raise ValueError(f"cpu assist: {len(order)} rows exceed the data segment's {self.layout.max_rows}")
        idx = torch.tensor(order, dtype=torch.long).to(self.device)
        self.step = StepAssist(idx, len(order), chunks)
        self.steps += 1
        segments = p.frame(b"S", json.dumps(self._segments(starts)))
        for h in {c[0] for c in chunks}:
            ok = all(self.pool.send(h, p.frame(b"R", self.cold[a].entry.to_json())) for a in self.cold)
            if not (ok and self.pool.send(h, segments)):
                self._fail(h)
        for cold in self.cold.values():
            self.stats.assisted += cold.requests
        self.lora.step.assist = self
        return self.rows_for_pools(rows)

    @staticmethod
    def _segments(starts: dict[int, list[int]]) -> list[tuple[int, int, int]]:
        out, lo = [], 0
        for aid, rows in starts.items():
            out.append((aid, lo, lo + len(rows)))
            lo += len(rows)
        return out

    def end(self) -> None:
        """After the forward: the step's fallbacks counted, the hook off."""
        st, self.step = self.step, None
        self.lora.step.assist = None
        if st is not None and st.fell_back:
            self.stats.fallbacks += sum(self.cold[a].requests for a in st.fell_back if a in self.cold)

    def _fail(self, h: int) -> None:
        st = self.step
        if st is not None and h not in st.dead:
            st.dead.add(h)
            self.pool.kill(h, "it failed a job")

    # ------------------------------------------------------------------ the LoraLinear hooks

    def send(self, layer: int, module_path: str, x: torch.Tensor) -> Pending | None:
        """Sends the assisted rows of ``x`` to the helpers for this module (before its base matmul)."""
        st = self.step
        m = self.module_index.get(module_path)
        if st is None or m is None:
            return None
        if self.sync_free:
            return self._send_signalled(st, layer, m, x)
        jobs = [c for c in st.chunks if (layer, m) in self.cold[c[3]].adapted]
        if not jobs:
            return None
        in_dim = x.shape[1]
        xv = self.data_t[: st.rows * in_dim * x.element_size()].view(x.dtype).view(st.rows, in_dim)
        xv.copy_(x.index_select(0, st.idx))  # CUDA: a synchronising copy (see the GPU design above)
        code = dtype_code(x.dtype)
        seqs: dict[int, int] = {}
        local = []
        for job in jobs:
            h, lo, hi, _ = job
            seq = None if h in st.dead else self.pool.submit(h, layer, m, lo, hi, st.rows, code)
            if seq is None:
                local.append(job)
                st.dead.add(h)
            else:
                seqs[h] = seq
        return Pending(layer, m, self.widths[m], jobs, seqs, local, time.monotonic())

    def add(self, pending: Pending, out: torch.Tensor) -> torch.Tensor:
        """Waits for ``pending``'s jobs (computing failed ones itself) and adds the results to ``out``."""
        st = self.step
        assert st is not None
        if pending.seq:
            return self._add_signalled(st, pending, out)
        jobs_rows = max(hi - lo for _, lo, hi, _ in pending.jobs)
        per_job = jobs_rows * self._macs(pending) / max(self.model.macs_per_ms, 1e-9)
        deadline = pending.sent_at + self._deadline_s(pending)
        failed = self.pool.wait(pending.seqs, deadline) if pending.seqs else set()
        local = list(pending.local)
        for job in pending.jobs:
            if job[0] in failed:
                local.append(job)
                self._fail(job[0])
        if not failed and pending.seqs:
            self.model.observe((time.monotonic() - pending.sent_at) * 1e3, per_job)
        width, rows = pending.width, st.rows
        res_np = self.pool.data.array(np.float32, rows * width, self.layout.out_offset).reshape(rows, width)
        covered = {(lo, hi) for _, lo, hi, _ in pending.jobs}
        for lo, hi, _ in self._uncovered(st, covered):
            res_np[lo:hi] = 0.0
        if local:
            in_dim = self.spec.modules[pending.module][0]
            code = dtype_code(out.dtype)
            x_np = self.pool.data.array(RAW_DTYPES[code], rows * in_dim, 0).reshape(rows, in_dim)
            for _, lo, hi, aid in local:
                entry = self.cold[aid].entry
                weights = adapter_weights(self.arena_np, entry)
                module_delta(
                    to_f32(x_np[lo:hi], code), weights, entry, self.spec, pending.layer, pending.module, res_np[lo:hi]
                )
                st.fell_back.add(aid)
        res = torch.from_numpy(res_np).to(out.device)
        sel = out.index_select(0, st.idx)
        return out.index_copy_(0, st.idx, (sel.float() + res).to(out.dtype))

    def _send_signalled(self, st: StepAssist, layer: int, m: int, x: torch.Tensor) -> Pending | None:
        """The sync-free send (``signalled.py``): a j frame per helper, the job to the watcher, then
        the copy of x's rows and the SEQ words queued on the stream. Every chunk of the step gets a
        job (a helper whose adapter does not adapt this module writes zeros), so the launching
        thread never writes the result rows the device may still be reading."""
        if not any((layer, m) in c.adapted for c in self.cold.values()):
            return None
        seq = self.pool.next_seq()
        rows, in_dim = st.rows, x.shape[1]
        code = dtype_code(x.dtype)
        procs: dict[int, Any] = {}
        for h, lo, hi, _ in st.chunks:
            proc = None if h in st.dead or self.watcher.is_dead(h) else self.pool.proc(h)
            if proc is not None and not self.pool.send(h, p.signalled_job_frame(seq, layer, m, lo, hi, rows, code)):
                proc = None
            if proc is None:
                st.dead.add(h)
            procs[h] = proc
        pending = Pending(layer, m, self.widths[m], list(st.chunks), {h: seq for h in procs}, [], time.monotonic(), seq)
        self.watcher.submit(
            SignalledJob(
                seq, layer, m, rows, code, in_dim, self.widths[m], list(st.chunks),
                {a: c.entry for a, c in self.cold.items()}, procs, self._deadline_s(pending), self.steps,
                {a: c.requests for a, c in self.cold.items()},
            )
        )  # fmt: skip
        dst = self.data_t[: rows * in_dim * x.element_size()].view(x.dtype).view(rows, in_dim)
        signal_op.send(x.index_select(0, st.idx), dst, self.words_t, p.SEQ, seq)
        return pending

    def _add_signalled(self, st: StepAssist, pending: Pending, out: torch.Tensor) -> torch.Tensor:
        """The sync-free add: the stream waits for every helper's DONE, then the rows come in."""
        for h in pending.seqs:
            signal_op.wait(
                self.words_t[h : h + 1], p.DONE, pending.seq, self.failed, timeout_s=DEVICE_GUARD_S, device=out.device
            )
        rows, width = st.rows, pending.width
        off = self.layout.out_offset
        res = self.data_t[off : off + rows * width * 4].view(torch.float32).view(rows, width)
        res = res.to(out.device, non_blocking=True) if out.device.type == "cuda" else res.clone()
        sel = out.index_select(0, st.idx)
        return out.index_copy_(0, st.idx, (sel.float() + res).to(out.dtype))

    def _deadline_s(self, pending: Pending) -> float:
        """How long a job of ``pending``'s shape may take before its rows are the worker's."""
        jobs_rows = max(hi - lo for _, lo, hi, _ in pending.jobs)
        per_job = jobs_rows * self._macs(pending) / max(self.model.macs_per_ms, 1e-9)
        return max(MIN_JOB_TIMEOUT_S, 20 * (per_job + self.model.overhead_ms) / 1e3)

    def _macs(self, pending: Pending) -> int:
        """Multiply-adds per row of one job of ``pending`` (the largest rank of the step's adapters)."""
        _, sl = self.spec.modules[pending.module]
        best = 0
        for cold in self.cold.values():
            e = cold.entry
            ranks = e.rank[pending.layer]
            best = max(best, sum(ranks[s] * (e.slices[s][2] + e.slices[s][3]) for s, _, _ in sl if ranks[s]))
        return best

    @staticmethod
    def _uncovered(st: StepAssist, covered: set[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """Chunks of the step with no job this module (their adapter does not adapt it)."""
        return [(lo, hi, aid) for _, lo, hi, aid in st.chunks if (lo, hi) not in covered]

    # ------------------------------------------------------------------ report

    def take_stats(self) -> AssistStats:
        """The decisions since the last call (also added to ``totals``)."""
        self.stats.fallbacks += self.watcher.take_fallbacks()
        got = self.stats.take()
        self.totals.assisted += got.assisted
        self.totals.fallbacks += got.fallbacks
        for reason, n in got.declined.items():
            self.totals.decline(reason, n)
        return got

    def close(self) -> None:
        self.land()
        self.watcher.close()
        self.pool.close()


__all__ = ["CpuAssist", "INVOCATIONS", "MIN_JOB_TIMEOUT_S", "dtype_code", "model_spec"]
