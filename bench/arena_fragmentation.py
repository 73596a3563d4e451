"""How often a host tier filled to its budget finds no contiguous room in its ``PinnedArena`` (CPU,
a simulation): the reads that would then be pinned on their own, the stall the arena exists to avoid.

A host tier keeps copies of S-LoRA S2's sizes (ranks 64 / 32 / 16 / 8 round-robin by adapter: sizes
8 : 4 : 2 : 1) within a budget, dropping the least recently used copy until the next one fits, as the
router's host tier does. Requests draw adapters with power-law popularity (alpha = 1) over n
adapters. The arena (unpinned, one ``ALIGN``-byte page per 16 MiB unit) is the budget plus a slack
(none, 5 %, or the worker's ``slack_for``), and its regions are placed best fit (``PinnedArena``)
or, for comparison, first fit.

    python3 -m bench.arena_fragmentation [--out DIR] [--requests 20000]
"""

from __future__ import annotations

import argparse
import collections
import random
from pathlib import Path

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import write_result  # noqa: E402
from deltaserve.adapters.pinned_arena import ALIGN, PinnedArena, slack_for  # noqa: E402

RANKS = (64, 32, 16, 8)
UNITS = {64: 8, 32: 4, 16: 2, 8: 1}
"""Copy sizes in arena units: S2's host copies are 134 / 67 / 34 / 17 MB (7B shape, q/k/v/o)."""
UNIT_BYTES = 16 << 20
"""What one unit stands for when the budget is sized in bytes (``slack_for``)."""


class FirstFitArena(PinnedArena):
    """The comparison: the lowest-addressed free range that fits."""

    def _best_fit(self, size: int) -> int | None:
        for start in self._free_starts:
            have = self._free[start]
            if have >= size:
                self._remove_free(start)
                if have > size:
                    self._add_free(start + size, have - size)
                return start
        return None


def run(n: int, budget: int, slack: float, fit: str, requests: int, seed: int) -> tuple[int, int]:
    """(reads, reads that found no room) for one simulated stream."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(n)]
    arena = (PinnedArena if fit == "best" else FirstFitArena)(int(budget * (1 + slack)) * ALIGN, pin=False)
    lru: collections.OrderedDict[int, tuple[int, object]] = collections.OrderedDict()
    used = reads = no_room = 0
    for _ in range(requests):
        a = rng.choices(range(n), weights)[0]
        if a in lru:
            lru.move_to_end(a)
            continue
        reads += 1
        size = UNITS[RANKS[a % len(RANKS)]]
        while used + size > budget:
            _, (dropped, view) = lru.popitem(last=False)
            used -= dropped
            if view is not None:
                arena.give(view)
        view = arena.take(size * ALIGN)
        no_room += view is None
        lru[a] = (size, view)
        used += size
    return reads, no_room


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    rows = []
    cases = [(2000, 3072, fit, slack) for fit in ("first", "best") for slack in (0.0, 0.05, 0.125)]
    # The worker's setting: best fit plus ``slack_for`` the budget (4 GiB and 48 GiB here).
    cases += [
        (n, budget, "best", slack_for(budget * UNIT_BYTES) / (budget * UNIT_BYTES))
        for budget in (256, 3072)
        for n in (1000, 5000)
    ]
    for n, budget, fit, slack in cases:
        got = [run(n, budget, slack, fit, args.requests, s) for s in range(args.seeds)]
        reads, no_room = sum(r for r, _ in got), sum(f for _, f in got)
        rows.append(
            {
                "n": n,
                "budget_largest_copies": budget // UNITS[64],
                "fit": fit,
                "slack": round(slack, 4),
                "reads": reads,
                "no_room": no_room,
                "no_room_share": no_room / reads,
            }
        )
        print(
            f"n {n:5d}, budget {budget // UNITS[64]:4d} largest copies, {fit:5s} fit, slack {slack:6.1%}: "
            f"{no_room:5d} of {reads:6d} reads found no room ({no_room / reads:.2%})",
            flush=True,
        )
    path = write_result(
        "arena_fragmentation",
        {
            "device": "cpu",
            "simulation": True,
            "sizes": UNITS,
            "popularity_alpha": 1.0,
            "requests_per_seed": args.requests,
            "seeds": args.seeds,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
