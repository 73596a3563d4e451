"""The worker's IPC loop: Hello, then one StepOutput (or WorkerError) per StepPlan, until Shutdown.

Protocol, as seen from the worker (frames are ``deltaserve.wire`` messages over the shared-memory
rings the router created in ``--ipc-dir``)::

    start ── open WorkerLink ── recv WorkerConfig (the router's first frame; see ``config``)
      │        ├─ another schema hash ──> send Hello(our schema_hash) ── the router refuses it ── exit 2
      │        └─ bad or missing config ──> send WorkerError(fatal, names the setting) ── exit 2
      ├─ load model + KV ──> send Hello(schema_hash, model, kv)
      │    └─ load fails ──> send WorkerError(fatal) ── exit 1
      ▼
    recv (1 s timeout) ── nothing ── parent gone? ── yes ──> exit 3
      │                               └─ no ──> recv again
      ├─ StepPlan N ──> executor.launch (queued on the device; nothing waits) ── N is in flight:
      │     │   recv while the device works on N ── StepPlan N+1 ──> launch N+1 behind N,
      │     │     │                                                 then finish N (below)
      │     │     └─ device done, no plan ──> finish N
      │     │   finish N: wait for its sampled tokens ──> send StepOutput(timing: gap, forward,
      │     │             total; adapter_host_bytes; host_ready: reads finished since)
      │     ├─ PlanError ──> finish the step in flight; send WorkerError(fatal=False, the step's
      │     │                req_ids); serve on
      │     ├─ a variant's files failed since InspectVariant (AdapterLoadError at its to_gpu) ──>
      │     │    that variant is quarantined (quarantine.py): its requests leave the step, the
      │     │    StepOutput reports it in failed_variants; serve on
      │     └─ anything else (CUDA error, OOM, bug) ──> send WorkerError(fatal) ── exit 1
      ├─ InspectVariant ──> finish the step in flight; executor.inspect_variant(path, kind) ──> send
      │                     VariantInfo(same inspect_id); state unchanged (an inspection that
      │                     raises is a refusal with the exception's type; traceback to the log)
      ├─ frame that does not decode / unexpected kind ──> finish the step in flight; send
      │                                                  WorkerError(fatal=False); serve on
      └─ Shutdown ──> finish the step in flight; exit 0

Every answer goes back in the order its frame came. Launching N+1 before N's tokens are on the
host is what overlaps the two: N+1's host work (decode, validation, batch building, launch) runs
while the device computes N, and a request that samples in N computes that token in N+1 straight
from N's sampled tensor (``Executor.launch``). On the CPU a launch computes the step before it
returns, so N is answered before N+1 is read.

``timing.gap_us`` is how long the device sat idle waiting for this plan: from the end of the
previous send (the Hello for the first plan) to this plan being decoded, the router's scheduling
plus both IPC hops, or 0 when it arrived while a step still ran on the device.
``timing.total_us`` runs from the plan being decoded to just before its output is encoded.
``timing.busy_us`` is this step's time alone: the same end, from the later of its plan being decoded
and the previous step's output (a step launched behind the one in flight waits for it in
``total_us``, not here), so the steps' ``busy_us`` add up to the worker's busy time.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from deltaserve import wire
from deltaserve.kernels import common as kernel_common

from . import config
from .config import ConfigError, SchemaMismatch, WorkerConfig
from .executor import Executor, LaunchedStep, PlanError
from .profiling import run_profiled

log = logging.getLogger("deltaserve.worker")

#: Exit code when the parent (router) died and nobody is left to serve.
EXIT_PARENT_GONE = 3
#: Exit code after a fatal error.
EXIT_FATAL = 1
#: Exit code for a bad configuration or a router of another wire schema.
EXIT_CONFIG = 2
#: How long a worker that refused the router's schema waits for the router to stop it.
SCHEMA_REFUSED_WAIT_S = 30.0
#: How long one ``recv`` blocks before the loop checks that its parent is alive.
POLL_SECONDS = 1.0
#: How long one ``recv`` waits while a step runs on the device before checking whether it is done.
BUSY_POLL_SECONDS = 50e-6
#: Longest traceback text sent in a fatal WorkerError (the full one goes to stderr).
MAX_ERROR_CHARS = 4000


class Link(Protocol):
    """The worker end of the rings (``deltaserve._native.WorkerLink``); a protocol for tests."""

    def send(self, data: bytes) -> None: ...

    def recv(self, timeout_s: float | None = None) -> bytes | None: ...


def traceback_summary(exc: BaseException) -> str:
    """``Type: message`` plus the innermost frames, short enough for one frame on the ring."""
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= MAX_ERROR_CHARS else "..." + text[-MAX_ERROR_CHARS:]


def step_req_ids(plan: wire.StepPlan) -> list[int]:
    """Every request a plan schedules, new first."""
    return [n.req_id for n in plan.new_requests] + [r.req_id for r in plan.running]


@dataclass
class InFlight:
    """A launched step whose output has not been sent, with its timing so far."""

    #: The executor's handle on it.
    launched: LaunchedStep
    #: When its plan was decoded (``timing.total_us`` runs from here to its output being encoded).
    decoded: float
    #: Its ``timing.gap_us``: how long the device sat idle waiting for its plan (0 when a step was
    #: still running on the device as the plan arrived).
    gap_us: int


class WorkerLoop:
    """Serves StepPlans from one link with one executor until Shutdown or a fatal error."""

    def __init__(
        self,
        executor: Executor,
        link: Link,
        poll_s: float = POLL_SECONDS,
        on_iteration: Callable[[], None] | None = None,
    ) -> None:
        self.executor = executor
        """Runs the plans."""
        self.link = link
        """Frames in and out."""
        self.poll_s = poll_s
        """recv timeout between parent-liveness checks."""
        self.parent_pid = os.getppid()
        """The router that spawned us; when our parent changes, it died."""
        self.last_send_end = time.perf_counter()
        """When the previous frame finished sending (start of the next plan's gap)."""
        self.in_flight: InFlight | None = None
        """The step launched on the device whose output is not sent yet."""
        self.last_output_at = 0.0
        """When the previous step's output was finished (``timing.busy_us`` starts no earlier)."""
        self.on_iteration = on_iteration
        """Called at the top of every loop iteration, on this thread (``profiling.run_profiled``
        dumps its stats from here: the router kills the worker right after Shutdown)."""

    def _send(self, msg: wire.Message) -> None:
        self.link.send(wire.encode(msg))
        self.last_send_end = time.perf_counter()

    def _send_error(self, step_id: int, message: str, fatal: bool, req_ids: list[int]) -> None:
        self._send(wire.WorkerError(step_id=step_id, message=message, fatal=fatal, req_ids=req_ids))

    def parent_alive(self) -> bool:
        ppid = os.getppid()
        return ppid == self.parent_pid and ppid != 1

    def run(self) -> int:
        """Sends Hello, then serves; returns the process exit code."""
        self._send(self.executor.hello(wire.SCHEMA_HASH))
        log.info("sent Hello (schema %s); serving", wire.SCHEMA_HASH)
        current: wire.StepPlan | None = None
        try:
            while True:
                if self.on_iteration is not None:
                    self.on_iteration()
                in_flight = self.in_flight
                busy = in_flight is not None
                frame = (
                    self._recv_while_busy(in_flight) if in_flight is not None else self.link.recv(timeout_s=self.poll_s)
                )
                if frame is None:
                    if busy:  # the device finished the step and no plan came: answer it
                        self._finish_in_flight()
                    elif not self.parent_alive():
                        log.error("parent process %d is gone; exiting", self.parent_pid)
                        return EXIT_PARENT_GONE
                    continue
                decoded = time.perf_counter()
                device_idle = in_flight is None or in_flight.launched.is_done()
                try:
                    msg = wire.decode(frame)
                except Exception as e:  # noqa: BLE001 - a bad frame is the sender's bug, reported back
                    log.error("undecodable frame (%d bytes): %s", len(frame), e)
                    self._finish_in_flight()
                    self._send_error(0, f"worker could not decode a frame of {len(frame)} bytes: {e}", False, [])
                    continue
                if not isinstance(msg, wire.StepPlan):
                    self._finish_in_flight()  # answers go back in the order the frames came
                if isinstance(msg, wire.Shutdown):
                    log.info("shutdown requested: %s", msg.reason or "(no reason)")
                    return 0
                if isinstance(msg, wire.InspectVariant):
                    info = self.inspect(msg)
                    info.inspect_id = msg.inspect_id
                    if info.error is not None:
                        log.warning("adapter %s refused: %s", msg.path, info.error)
                    self._send(info)
                    continue
                if not isinstance(msg, wire.StepPlan):
                    log.error("unexpected message %s", type(msg).__name__)
                    kind = type(msg).__name__
                    self._send_error(
                        0, f"worker expected a StepPlan, InspectVariant or Shutdown, got {kind}", False, []
                    )
                    continue
                current = msg
                gap_us = int((decoded - self.last_send_end) * 1e6) if device_idle else 0
                try:
                    with torch.inference_mode():
                        launched = self.executor.launch(msg, in_flight.launched if in_flight is not None else None)
                except PlanError as e:
                    self._finish_in_flight()
                    failed = self.executor.drop_step_requests(msg)
                    log.warning("%s (failing requests %s)", e, failed)
                    self._send_error(msg.step_id, str(e), False, failed)
                    current = None
                    continue
                # The device now has this step queued behind the one in flight: answer that one.
                self._finish_in_flight()
                self.in_flight = InFlight(launched, decoded, gap_us)
                current = None
        except Exception as e:  # noqa: BLE001 - fatal by definition: report, then exit non-zero
            step_id = current.step_id if current else (self.in_flight.launched.step_id if self.in_flight else 0)
            log.critical("fatal error in step %s:\n%s", step_id or "-", "".join(traceback.format_exception(e)))
            try:
                req_ids = step_req_ids(current) if current is not None else []
                if self.in_flight is not None:
                    req_ids += [state.req_id for state, _ in self.in_flight.launched.scheduled]
                self._send_error(step_id, traceback_summary(e), True, list(dict.fromkeys(req_ids)))
            except Exception as send_error:  # noqa: BLE001 - the link itself may be what broke
                log.error("could not report the fatal error: %s", send_error)
            return EXIT_FATAL

    def inspect(self, msg: wire.InspectVariant) -> wire.VariantInfo:
        """The executor's answer to ``msg``; whatever a directory holds, an inspection that raises
        is a refusal of that directory (traceback to the log, not to the client), never fatal."""
        try:
            return self.executor.inspect_variant(msg.path, msg.kind)
        except Exception as e:  # noqa: BLE001 - a crafted file must not stop the worker
            log.error("inspecting %s raised:\n%s", msg.path, "".join(traceback.format_exception(e)))
            return wire.VariantInfo(error=f"the variant's files could not be inspected ({type(e).__name__})")

    def _recv_while_busy(self, in_flight: InFlight) -> bytes | None:
        """The next frame if one arrives before the device finishes ``in_flight``'s step, else None.

        While the device still works on the step, the next plan can be launched behind it (the
        router sends it without waiting for this step's output when it can; see ``actor.rs``).
        Once the device is done, nothing is gained by waiting: the output goes back first.
        """
        while not in_flight.launched.is_done():
            frame = self.link.recv(timeout_s=BUSY_POLL_SECONDS)
            if frame is not None:
                return frame
        return None

    def _finish_in_flight(self) -> None:
        """Waits for the step in flight (if any), sends its StepOutput and clears it."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        with torch.inference_mode():
            out = self.executor.finish(in_flight.launched)
        now = time.perf_counter()
        out.timing.gap_us = in_flight.gap_us
        out.timing.total_us = int((now - in_flight.decoded) * 1e6)
        out.timing.busy_us = int((now - max(in_flight.decoded, self.last_output_at)) * 1e6)
        self.last_output_at = now
        self._send(out)


def configure_process(cfg: WorkerConfig) -> None:
    """Logging to stderr (the router captures it), torch's CPU thread count, the kernel backend, the
    CUDA C++ ops' switch and build cache."""
    from deltaserve.kernels import cuda_ext

    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(name)s[{os.getpid()}] %(levelname)s %(message)s",
    )
    if cfg.device == "cpu":
        threads = cfg.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        log.info("using %d CPU threads", threads)
    elif cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    kernel_common.set_backend(wire.KernelBackend(cfg.kernels).label)
    cuda_ext.configure(enabled=cfg.cuda_ops, cache_dir=cfg.cache_dir)


def receive_config(link: Link) -> WorkerConfig | int:
    """The router's validated WorkerConfig, or the exit code after refusing it: a bad config is
    reported as a fatal WorkerError; another schema is answered with a Hello carrying ours, which
    the router refuses naming both hashes (then it stops us)."""
    try:
        return config.from_frame(link.recv(timeout_s=config.CONFIG_TIMEOUT_S))
    except SchemaMismatch as e:
        print(f"deltaserve.worker: wire schema mismatch: {e}", file=sys.stderr)
        link.send(wire.encode(wire.Hello(schema_hash=wire.SCHEMA_HASH, pid=os.getpid())))
        link.recv(timeout_s=SCHEMA_REFUSED_WAIT_S)  # the router kills us once it has read the Hello
        return EXIT_CONFIG
    except ConfigError as e:
        print(f"deltaserve.worker: {e}", file=sys.stderr)
        link.send(wire.encode(wire.WorkerError(step_id=0, message=f"bad worker config: {e}", fatal=True)))
        return EXIT_CONFIG


def freeze_loaded_objects() -> None:
    """Collects once, then moves every object alive after the load (modules, the model, the caches:
    ~236 k objects with torch, triton and the worker imported) out of the garbage collector's
    generations (``gc.freeze``), so the collections that a serving worker's per-step objects trigger
    no longer scan them. A full collection of that heap took 106-113 ms on this project's idle CPU
    machine (``bench/gc_pause.py``), the size of the stalls an H200 S-LoRA S2 recording shows every 48-60 steps at ~250
    running requests (0.11-0.18 s in a step's finish or before its output: bench/README, simulator
    section); frozen, it takes ~0 ms. Objects made later are collected as usual (vLLM's worker
    freezes its start-up heap the same way)."""
    gc.collect()
    gc.freeze()


def serve(ipc_dir: Path) -> int:
    """The whole worker process: open the link, receive the config, load, Hello, serve. Returns the
    exit code."""
    from deltaserve._native import WorkerLink

    first = WorkerLink(str(ipc_dir))
    cfg = receive_config(first)
    if isinstance(cfg, int):
        return cfg
    configure_process(cfg)
    # Reopened with the configured polling (the rings' cursors live in the shared files).
    del first
    link = WorkerLink(str(ipc_dir), spin_us=cfg.recv_spin_us)

    def load_and_serve(on_iteration: Callable[[], None] | None = None) -> int:
        try:
            executor = Executor.from_config(cfg)
        except Exception as e:  # noqa: BLE001 - cannot serve: tell the router why, then exit
            log.critical("could not load the model:\n%s", "".join(traceback.format_exception(e)))
            try:
                msg = wire.WorkerError(step_id=0, message=traceback_summary(e), fatal=True, req_ids=[])
                link.send(wire.encode(msg))
            except Exception as send_error:  # noqa: BLE001
                log.error("could not report the load failure: %s", send_error)
            return EXIT_FATAL
        freeze_loaded_objects()  # the worker process only (in-process tests keep their collector as it is)
        return WorkerLoop(executor, link, on_iteration=on_iteration).run()

    if cfg.profile_path:
        return run_profiled(load_and_serve, f"{cfg.profile_path}.{os.getpid()}", cfg.profile_every_s)
    return load_and_serve()
