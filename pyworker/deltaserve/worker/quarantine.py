"""Variants whose files failed after registration, kept apart so they fail only their own requests.

A variant's files can change, vanish or turn out corrupt after ``InspectVariant`` accepted them;
the host read then fails in the background and the ``to_gpu`` that needs it raises
``AdapterLoadError``. That is the variant's failure, not the worker's::

    to_gpu X raises AdapterLoadError ─▶ quarantine X (its host entry dropped; nothing was placed)
        ├─ this step and every later one: X's requests leave the plan (their state dropped),
        │  X's ops are skipped (the router's drops of X find nothing to drop)
        ├─ the next StepOutput reports it: ``failed_variants`` [(X, message naming the failure)];
        │  the router fails X's requests with that message, marks X unavailable and unregisters it
        └─ a later ``to_host`` X (X registered again) lifts the quarantine: the read is retried

The message never carries a traceback or a server path (those go to the worker's log).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, MutableMapping

from deltaserve import wire

from .requests import RequestState

log = logging.getLogger(__name__)


class Quarantine:
    """The worker's quarantined variant ids, and the failures not reported to the router yet."""

    def __init__(self) -> None:
        self.reasons: dict[int, str] = {}
        """Quarantined variant id -> why (the message the router gets)."""
        self.unreported: list[wire.FailedVariant] = []
        """Failures since the last ``take_reports``."""
        self.dropped: set[int] = set()
        """Requests of quarantined variants whose state was dropped, until the router releases
        them (a plan formed before the router heard of the failure still runs them)."""

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self.reasons

    def add(self, variant_id: int, what: str, error: BaseException) -> None:
        """Quarantines ``variant_id`` after ``error`` (logged in full); ``what`` says what failed,
        e.g. "its files could not be loaded"."""
        log.error("variant %d quarantined: %s: %s", variant_id, what, error)
        message = f"{what} ({type(error).__name__}); register it again once its files are fixed"
        self.reasons[variant_id] = message
        self.unreported.append(wire.FailedVariant(variant_id=variant_id, message=message))

    def lift(self, variant_id: int) -> None:
        """Forgets ``variant_id`` (a ``to_host`` of it: registered again, or a retry)."""
        self.reasons.pop(variant_id, None)

    def lift_reloaded(self, plan: wire.StepPlan) -> None:
        """Lifts the quarantine of every variant ``plan`` reads again (``to_host``): registered
        again, or the router retrying; call before ``filter_plan`` at the start of a step."""
        for op in plan.adapter_ops:
            if op.op == wire.TierOp.TO_HOST:
                self.lift(op.adapter_id)

    def take_reports(self) -> list[wire.FailedVariant]:
        """The failures to report in the next StepOutput (each once)."""
        out, self.unreported = self.unreported, []
        return out

    def filter_plan(self, plan: wire.StepPlan, requests: MutableMapping[int, RequestState]) -> wire.StepPlan:
        """``plan`` without the quarantined variants' ops and requests (their worker state is
        dropped: the router fails them on the report). ``plan`` itself when nothing is removed."""
        self.dropped.difference_update(plan.released)
        if not self.reasons and not self.dropped:
            return plan
        ops = [op for op in plan.adapter_ops if op.adapter_id not in self.reasons]
        new = [n for n in plan.new_requests if n.adapter_id not in self.reasons]
        running = [r for r in plan.running if not self._quarantined(requests, r.req_id)]
        if (
            len(ops) == len(plan.adapter_ops)
            and len(new) == len(plan.new_requests)
            and len(running) == len(plan.running)
        ):
            return plan
        for r in plan.running:
            if self._quarantined(requests, r.req_id):
                requests.pop(r.req_id, None)
                self.dropped.add(r.req_id)
        self.dropped.update(n.req_id for n in plan.new_requests if n.adapter_id in self.reasons)
        return dataclasses.replace(plan, adapter_ops=ops, new_requests=new, running=running)

    def _quarantined(self, requests: Mapping[int, RequestState], req_id: int) -> bool:
        if req_id in self.dropped:
            return True
        state = requests.get(req_id)
        return state is not None and state.variant_id in self.reasons
