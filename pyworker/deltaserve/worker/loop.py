"""The worker's IPC loop: Hello, then one StepOutput (or WorkerError) per StepPlan, until Shutdown.

Protocol, as seen from the worker (frames are ``deltaserve.wire`` messages over the shared-memory
rings the router created in ``--ipc-dir``)::

    start ── open WorkerLink ── load model + KV ──> send Hello(schema_hash, model, kv)
      │                              └─ load fails ──> send WorkerError(fatal) ── exit 1
      ▼
    recv (1 s timeout) ── nothing ── parent gone? ── yes ──> exit 3
      │                               └─ no ──> recv again
      ├─ StepPlan ──> executor.step ──> send StepOutput(timing: gap, forward, total; adapter_host_bytes)
      │                 ├─ PlanError ──> send WorkerError(fatal=False, the step's req_ids); serve on
      │                 └─ anything else (CUDA error, OOM, bug, AdapterLoadError: an adapter op
      │                    that cannot be applied, e.g. a to_host whose directory vanished since
      │                    InspectAdapter) ──> send WorkerError(fatal) ── exit 1
      ├─ InspectAdapter ──> executor.inspect_adapter ──> send AdapterInfo(same inspect_id); state unchanged
      ├─ frame that does not decode / unexpected kind ──> send WorkerError(fatal=False); serve on
      └─ Shutdown ──> exit 0

``timing.gap_us`` runs from the end of the previous send (the Hello for the first plan) to this
plan being decoded: the router's scheduling plus both IPC hops. ``timing.total_us`` runs from the
plan being decoded to just before the output is encoded.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Protocol

import torch

from deltaserve import wire
from deltaserve.kernels import common as kernel_common

from .config import WorkerConfig
from .executor import Executor, PlanError

log = logging.getLogger("deltaserve.worker")

#: Exit code when the parent (router) died and nobody is left to serve.
EXIT_PARENT_GONE = 3
#: Exit code after a fatal error.
EXIT_FATAL = 1
#: How long one ``recv`` blocks before the loop checks that its parent is alive.
POLL_SECONDS = 1.0
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


class WorkerLoop:
    """Serves StepPlans from one link with one executor until Shutdown or a fatal error."""

    def __init__(self, executor: Executor, link: Link, poll_s: float = POLL_SECONDS) -> None:
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

    def _send(self, msg: object) -> None:
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
                frame = self.link.recv(timeout_s=self.poll_s)
                if frame is None:
                    if not self.parent_alive():
                        log.error("parent process %d is gone; exiting", self.parent_pid)
                        return EXIT_PARENT_GONE
                    continue
                try:
                    msg = wire.decode(frame)
                except Exception as e:  # noqa: BLE001 - a bad frame is the sender's bug, reported back
                    log.error("undecodable frame (%d bytes): %s", len(frame), e)
                    self._send_error(0, f"worker could not decode a frame of {len(frame)} bytes: {e}", False, [])
                    continue
                decoded = time.perf_counter()
                if isinstance(msg, wire.Shutdown):
                    log.info("shutdown requested: %s", msg.reason or "(no reason)")
                    return 0
                if isinstance(msg, wire.InspectAdapter):
                    info = self.executor.inspect_adapter(msg.path)
                    info.inspect_id = msg.inspect_id
                    if info.error is not None:
                        log.warning("adapter %s refused: %s", msg.path, info.error)
                    self._send(info)
                    continue
                if not isinstance(msg, wire.StepPlan):
                    log.error("unexpected message %s", type(msg).__name__)
                    kind = type(msg).__name__
                    self._send_error(0, f"worker expected a StepPlan, InspectAdapter or Shutdown, got {kind}", False, [])
                    continue
                current = msg
                gap_us = int((decoded - self.last_send_end) * 1e6)
                try:
                    with torch.inference_mode():
                        out = self.executor.step(msg)
                except PlanError as e:
                    failed = self.executor.drop_step_requests(msg)
                    log.warning("%s (failing requests %s)", e, failed)
                    self._send_error(msg.step_id, str(e), False, failed)
                    current = None
                    continue
                out.timing.gap_us = gap_us
                out.timing.total_us = int((time.perf_counter() - decoded) * 1e6)
                self._send(out)
                current = None
        except Exception as e:  # noqa: BLE001 - fatal by definition: report, then exit non-zero
            log.critical("fatal error in step %s:\n%s", current.step_id if current else "-", "".join(traceback.format_exception(e)))
            try:
                step_id = current.step_id if current is not None else 0
                req_ids = step_req_ids(current) if current is not None else []
                self._send_error(step_id, traceback_summary(e), True, req_ids)
            except Exception as send_error:  # noqa: BLE001 - the link itself may be what broke
                log.error("could not report the fatal error: %s", send_error)
            return EXIT_FATAL


def configure_process(cfg: WorkerConfig) -> None:
    """Logging to stderr (the router captures it), torch's CPU thread count, the kernel backend."""
    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(name)s[{os.getpid()}] %(levelname)s %(message)s",
    )
    if cfg.device == "cpu":
        threads = cfg.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        log.info("using %d CPU threads", threads)
    kernel_common.set_backend(cfg.kernels)


def serve(cfg: WorkerConfig) -> int:
    """The whole worker process: open the link, load, Hello, serve. Returns the exit code."""
    from deltaserve._native import WorkerLink

    configure_process(cfg)
    link = WorkerLink(str(cfg.ipc_dir), spin_us=cfg.recv_spin_us)
    try:
        executor = Executor.from_config(cfg)
    except Exception as e:  # noqa: BLE001 - cannot serve: tell the router why, then exit
        log.critical("could not load the model:\n%s", "".join(traceback.format_exception(e)))
        try:
            link.send(wire.encode(wire.WorkerError(step_id=0, message=traceback_summary(e), fatal=True, req_ids=[])))
        except Exception as send_error:  # noqa: BLE001
            log.error("could not report the load failure: %s", send_error)
        return EXIT_FATAL
    return WorkerLoop(executor, link).run()
