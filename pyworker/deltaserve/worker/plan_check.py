"""Plan validation: every reference a ``StepPlan`` makes, checked against the worker's state before
anything is applied. A bad plan is a ``PlanError`` listing all its problems; the state is untouched.

Checked, in this order:

- the variant ops (``adapter_ops``), replayed on copies of every pool's tiers (``VariantPool``:
  ``host_ids`` and ``placements``). The state machine they follow is the router's, drawn once in
  ``router/crates/sched/src/adapters.rs``; the replay checks each op against it (a ``to_host`` of a
  variant already on the host, a ``to_gpu`` without a host copy, ...) and the kind's own rules for
  a placement (``Placements.problem``: a LoRA adapter's pages, a delta's slot);
- new requests: not held already, tokens in the vocab and within ``max_model_len``, enough pages
  inside the pool, sane sampling, a variant GPU-resident after the ops, no page holding variant
  weights;
- running requests: held, scheduled once, tokens known, enough pages, variant resident;
- the step as a whole: each pool's per-step limit (``VariantPool.step_problem``), and no page a
  ``to_gpu`` fills holding request KV after the step.

The context-length limit is checked again here although the router checked it (``validate.rs``)
and its scheduler keeps to it: the worker must never index past its KV pool, whoever sent the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltaserve import wire
from deltaserve.adapters.variants import OFF_REASON, WITH_ARTICLE, Placements, VariantKind, VariantPool

from .requests import RequestState


class PlanError(ValueError):
    """A StepPlan refers to something the worker does not hold or cannot do.

    Recoverable: the executor's state is untouched; ``req_ids`` are the offending requests.
    """

    def __init__(self, message: str, req_ids: list[int]) -> None:
        super().__init__(message)
        #: The requests the problems were found in (empty when the plan as a whole is bad).
        self.req_ids = req_ids


@dataclass(frozen=True)
class PlanLimits:
    """The worker's fixed bounds a plan is checked against."""

    vocab_size: int
    num_blocks: int
    """Pages the router allocates."""
    block_size: int
    max_model_len: int


@dataclass
class VariantsAfter:
    """Where the variants are once a plan's ops are applied (the replay's result)."""

    on_gpu: dict[int, VariantKind] = field(default_factory=dict)
    """GPU-resident variant id -> its kind."""
    pages: dict[int, int] = field(default_factory=dict)
    """KV-pool page -> the variant whose weights it holds."""


OPS = ", ".join(op.label for op in wire.TierOp)
KINDS = ", ".join(kind.label for kind in VariantKind)


def replay_variant_ops(
    plan: wire.StepPlan, pools: Mapping[VariantKind, VariantPool], problems: list[str]
) -> VariantsAfter:
    """Replays ``plan.adapter_ops`` on copies of every pool's tiers, appending what is wrong."""
    host = {kind: set(pool.host_ids()) for kind, pool in pools.items()}
    placed: dict[VariantKind, Placements] = {kind: pool.placements() for kind, pool in pools.items()}

    def held_as(aid: int) -> VariantKind | None:
        return next((kind for kind in pools if aid in host[kind] or aid in placed[kind].ids()), None)

    for i, op in enumerate(plan.adapter_ops):
        aid = op.adapter_id
        move = next((m for m in wire.TierOp if m == op.op), None)  # op.op may be any int in-process
        kind = next((k for k in VariantKind if k == op.kind), None)

        def bad(what: str) -> None:
            name = move.label if move is not None else f"op {op.op!r}"
            problems.append(f"adapter op {i} ({name} adapter {aid}): {what}")

        if move is None:
            bad(f"unknown op {op.op!r} (expected one of {OPS})")
            continue
        if kind is None:
            bad(f"unknown variant kind {op.kind!r} (expected one of {KINDS})")
            continue
        if aid == 0:
            bad("adapter id 0 is the base model")
            continue
        holder = held_as(aid)
        if kind not in pools:
            bad(OFF_REASON[kind])
            continue
        on_host, gpu = host[kind], placed[kind]
        if holder is not None and holder != kind:
            bad(f"the id is {WITH_ARTICLE[holder]} on this worker")
        elif move is wire.TierOp.TO_HOST:
            if aid in on_host:
                bad("already in host memory (drop_host first)")
            elif not op.path:
                bad("no path")
            else:
                on_host.add(aid)
        elif move is wire.TierOp.TO_GPU:
            if aid not in on_host:
                bad("not in host memory (a to_host must come first)")
            elif aid in gpu.ids():
                bad("already on the GPU (drop_gpu first)")
            elif (problem := gpu.problem(op)) is not None:
                bad(problem)
            else:
                gpu.place(op)
        elif move is wire.TierOp.DROP_GPU:
            if aid not in gpu.ids():
                bad("not on the GPU")
            else:
                gpu.remove(aid)
        else:  # drop_host
            if aid not in on_host:
                bad("not in host memory")
            else:
                on_host.discard(aid)
    after = VariantsAfter()
    for kind, p in placed.items():
        after.on_gpu.update((aid, kind) for aid in p.ids())
        after.pages.update(p.pages())
    return after


def check_plan(
    plan: wire.StepPlan,
    requests: Mapping[int, RequestState],
    pools: Mapping[VariantKind, VariantPool],
    limits: PlanLimits,
) -> None:
    """Checks every reference in ``plan`` against the state; raises PlanError listing all problems."""
    problems: list[str] = []
    bad: list[int] = []

    def fail(req_id: int, what: str) -> None:
        problems.append(f"request {req_id}: {what}")
        if req_id not in bad:
            bad.append(req_id)

    vocab, num_blocks, bs = limits.vocab_size, limits.num_blocks, limits.block_size

    def check_blocks(req_id: int, blocks: list[int], needed_tokens: int, have: int) -> None:
        out_of_pool = [b for b in blocks if not 0 <= b < num_blocks]
        if out_of_pool:
            fail(req_id, f"block ids {out_of_pool[:4]} outside the pool of {num_blocks} blocks")
        if (have + len(blocks)) * bs < needed_tokens:
            fail(req_id, f"{have + len(blocks)} blocks of {bs} tokens cannot hold {needed_tokens} tokens")

    released = set(plan.released)
    held_after_release = set(requests) - released
    after = replay_variant_ops(plan, pools, problems)
    resident = ", ".join(map(str, sorted(after.on_gpu))) or "none"

    def check_variant(req_id: int, adapter_id: int) -> None:
        if adapter_id != 0 and adapter_id not in after.on_gpu:
            fail(
                req_id,
                f"adapter_id {adapter_id} is not on the GPU after this step's adapter ops "
                f"(resident: {resident}; 0 = base model)",
            )

    def check_not_variant_pages(req_id: int, blocks: list[int]) -> None:
        taken = [b for b in blocks if b in after.pages]
        if taken:
            fail(req_id, f"KV block ids {taken[:4]} hold adapter {after.pages[taken[0]]}'s weights")

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
        # A deliberate guard, not the rule: the router refuses longer requests before they are
        # queued (sched ``context_room``); a plan past it is a router bug, refused before it runs.
        if n_tokens > limits.max_model_len:
            fail(rid, f"{n_tokens} tokens exceed max_model_len {limits.max_model_len}")
        if new.num_prompt_tokens > n_tokens:
            fail(rid, f"num_prompt_tokens {new.num_prompt_tokens} > {n_tokens} known tokens")
        end = new.num_computed_tokens + new.num_scheduled_tokens
        if end > n_tokens:
            fail(rid, f"schedules tokens up to {end} but only {n_tokens} are known")
        check_blocks(rid, list(new.block_ids), end, 0)
        if new.sampling.temperature < 0 or not 0.0 <= new.sampling.top_p <= 1.0:
            fail(rid, f"bad sampling params {new.sampling}")
        if new.num_scheduled_tokens > 0:
            check_variant(rid, new.adapter_id)
        check_not_variant_pages(rid, list(new.block_ids))

    running_ids: set[int] = set()
    for run in plan.running:
        rid = run.req_id
        state = requests.get(rid)
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
        check_variant(rid, state.variant_id)
        check_not_variant_pages(rid, list(run.new_block_ids))

    step_variants = {n.adapter_id for n in plan.new_requests if n.num_scheduled_tokens > 0} | {
        requests[r.req_id].variant_id for r in plan.running if r.req_id in requests
    }
    for kind, pool in pools.items():
        problem = pool.step_problem({v for v in step_variants if after.on_gpu.get(v) == kind})
        if problem is not None:
            problems.append(problem)

    placed = [(i, op) for i, op in enumerate(plan.adapter_ops) if op.op == wire.TierOp.TO_GPU and op.block_ids]
    if placed:  # pages a variant moves into must hold no request's KV after this step
        kv_pages = {b for rid in held_after_release for b in requests[rid].block_table}
        kv_pages.update(b for new in plan.new_requests for b in new.block_ids)
        kv_pages.update(b for run in plan.running for b in run.new_block_ids)
        for i, op in placed:
            clash = [b for b in op.block_ids if b in kv_pages]
            if clash:
                problems.append(
                    f"adapter op {i} (to_gpu adapter {op.adapter_id}): block ids {clash[:4]} hold request KV"
                )

    if problems:
        raise PlanError(f"step {plan.step_id}: bad plan: " + "; ".join(problems), bad)
