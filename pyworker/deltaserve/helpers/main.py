"""One CPU LoRA helper process: ``python -m deltaserve.helpers.main`` (the pool starts it).

It pins itself to its core, maps the worker's segments (the arena read-only), profiles one shrink +
expand, says hello, then serves jobs until the worker says ``Q`` or goes away (EOF on its pipe; the
kernel also kills it with the worker: ``PR_SET_PDEATHSIG``). State machine::

    start ─ pin, map, profile ─ H ─> idle ─ R / S ─> idle ─ J ─> compute ─ DONE = SEQ, d ─> idle
                                         │       └─ j ─> wait SEQ word ─> compute ─ DONE = seq ─> idle
                                         └─ Q or EOF ─> exit

The only state is the step's adapters (``R``) and segments (``S``); a failed ``J`` job sets
``STATUS`` 1 and answers like a finished one, so the worker computes that job itself. A signalled
job (``j``, the sync-free path) waits for the device's SEQ word (x's rows are in the data segment
then), answers with DONE alone (no ``d``: the device waits on the word, and the worker's watcher
polls it), and on failure writes FAILED = seq and leaves DONE for the watcher.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time

import numpy as np

from . import protocol as p
from .compute import RAW_DTYPES, adapter_weights, module_delta, profile_macs_per_ms, to_f32
from .shm import attach, readonly_array

PR_SET_PDEATHSIG = 1
SIGNAL_SPIN_S = 2e-4
"""A signalled job spins this long on the SEQ word before it sleeps between looks."""
SIGNAL_POLL_S = 5e-5
"""Sleep between looks at the SEQ word after the spin."""
SIGNAL_LOST_S = 120.0
"""A signalled job whose SEQ never comes (the step failed on the device) is dropped after this."""


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when the worker (its parent) exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: EOF on the pipe still ends it
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m deltaserve.helpers.main")
    ap.add_argument("--index", type=int, required=True, help="Row of the control segment.")
    ap.add_argument("--core", type=int, default=-1, help="CPU to pin to (-1: no pinning).")
    ap.add_argument("--cmd-fd", type=int, required=True)
    ap.add_argument("--reply-fd", type=int, required=True)
    ap.add_argument("--arena-fd", type=int, required=True)
    ap.add_argument("--arena-size", type=int, required=True)
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--control-size", type=int, required=True)
    ap.add_argument("--data-fd", type=int, required=True)
    ap.add_argument("--data-size", type=int, required=True)
    ap.add_argument("--out-offset", type=int, required=True)
    ap.add_argument("--spec", required=True, help="ModelSpec as JSON.")
    return ap.parse_args(argv)


class Helper:
    """The mapped segments and the step's adapters of one helper."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.index = a.index
        self.cmd, self.reply = a.cmd_fd, a.reply_fd
        self.spec = p.ModelSpec.from_json(a.spec)
        arena_map = attach(a.arena_fd, a.arena_size, writable=False)
        self.arena = readonly_array(arena_map, np.uint8, a.arena_size, 0)
        self.control = np.frombuffer(attach(a.control_fd, a.control_size, writable=True), dtype=np.int64)
        self.row = self.control[self.index * p.JOB_WORDS : (self.index + 1) * p.JOB_WORDS]
        self.data = attach(a.data_fd, a.data_size, writable=True)
        self.out_offset = a.out_offset
        self.adapters: dict[int, tuple[p.AdapterEntry, np.ndarray]] = {}
        self.segments: list[tuple[int, int, int]] = []

    def run(self) -> None:
        while True:
            kind = p.read_exact(self.cmd, 1)
            if kind in (b"", b"Q"):
                return
            if kind == b"J":
                self.job()
                continue
            if kind == b"j":
                raw = p.read_exact(self.cmd, p.SIGNALLED_JOB.size)
                if len(raw) != p.SIGNALLED_JOB.size:
                    return
                self.signalled_job(*p.SIGNALLED_JOB.unpack(raw))
                continue
            payload = p.read_payload(self.cmd)
            if payload is None:
                return
            if kind == b"R":
                entry = p.AdapterEntry.from_json(payload)
                self.adapters[entry.adapter_id] = (entry, adapter_weights(self.arena, entry))
            elif kind == b"S":
                import json

                self.segments = [(int(a), int(lo), int(hi)) for a, lo, hi in json.loads(payload)]
                keep = {a for a, _, _ in self.segments}
                self.adapters = {k: v for k, v in self.adapters.items() if k in keep}

    def job(self) -> None:
        row = self.row
        seq = int(row[p.SEQ])
        status = 0
        try:
            self.compute(
                int(row[p.LAYER]),
                int(row[p.MODULE]),
                int(row[p.LO]),
                int(row[p.HI]),
                int(row[p.ROWS]),
                int(row[p.DTYPE]),
            )
        except Exception as e:  # noqa: BLE001 - any failure: the worker computes this job itself
            print(f"deltaserve cpu-lora helper {self.index}: job {seq} failed: {e!r}", file=sys.stderr)
            status = 1
        row[p.STATUS] = status
        row[p.DONE] = seq
        os.write(self.reply, b"d")

    def signalled_job(self, seq: int, layer: int, module: int, lo: int, hi: int, rows: int, code: int) -> None:
        """A ``j`` job: once the device's SEQ word reaches ``seq``, the rows; then DONE (or FAILED)."""
        row = self.row
        start = time.monotonic()
        while int(row[p.SEQ]) < seq:
            waited = time.monotonic() - start
            if waited > SIGNAL_LOST_S:
                print(f"deltaserve cpu-lora helper {self.index}: job {seq} never signalled", file=sys.stderr)
                return
            if waited > SIGNAL_SPIN_S:
                time.sleep(SIGNAL_POLL_S)
        try:
            self.compute(layer, module, lo, hi, rows, code)
        except Exception as e:  # noqa: BLE001 - any failure: the worker's watcher computes this job
            print(f"deltaserve cpu-lora helper {self.index}: job {seq} failed: {e!r}", file=sys.stderr)
            row[p.FAILED] = seq
            return
        row[p.DONE] = seq

    def compute(self, layer: int, module: int, lo: int, hi: int, rows: int, code: int) -> None:
        in_dim, slices = self.spec.modules[module]
        width = max((c + n for _, c, n in slices), default=0)
        raw = RAW_DTYPES[code]
        x_all = np.frombuffer(self.data, dtype=raw, count=rows * in_dim, offset=0).reshape(rows, in_dim)
        out_all = np.frombuffer(self.data, dtype=np.float32, count=rows * width, offset=self.out_offset)
        out_all = out_all.reshape(rows, width)
        for adapter, s_lo, s_hi in self.segments:
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a >= b:
                continue
            entry, weights = self.adapters[adapter]
            module_delta(to_f32(x_all[a:b], code), weights, entry, self.spec, layer, module, out_all[a:b])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    die_with_parent()
    if a.core >= 0:
        try:
            os.sched_setaffinity(0, {a.core})
        except OSError as e:
            print(f"deltaserve cpu-lora helper {a.index}: cannot pin to CPU {a.core}: {e}", file=sys.stderr)
    helper = Helper(a)
    macs = profile_macs_per_ms(helper.spec.hidden_size)
    os.write(helper.reply, p.frame(b"H", p.hello_payload(os.getpid(), a.core, macs)))
    helper.run()
    return 0


if __name__ == "__main__":
    from deltaserve.child_process import run_child

    run_child(main)  # SIGINT left to the worker and router, no interpreter teardown (child_process)
