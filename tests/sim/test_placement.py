"""The simulator places arrivals with the router's own ``--placement`` policies
(router/crates/py/src/sim_placement.rs over router/crates/server/src/engine/placement.rs):
every policy is accepted and decides deterministically on constructed traces; an unknown name
is refused by name. Tiny traces: the whole module runs in well under a second of simulation."""

from __future__ import annotations

import json

import pytest

from deltaserve import _native, sim
from deltaserve.sim.__main__ import main
from deltaserve.sim.trace import from_requests

POLICIES = ("caraserve", "least-loaded", "first-fit", "random")
VARIANTS = [{"name": "a", "kind": "lora", "rank": 8}, {"name": "b", "kind": "lora", "rank": 64}]


def workers_of(requests: list[dict], placement: str, workers: int = 3, **kw) -> list[int]:
    res = sim.replay(from_requests(requests, VARIANTS), workers=workers, placement=placement, **kw)
    assert res.completed.all() and res.config["placement"] == placement
    return res.worker_of.tolist()


def req(t: float, variant: str | None, output_len: int = 2000) -> dict:
    return {"t": t, "variant": variant, "prompt_len": 32, "output_len": output_len}


# Two long requests of different adapters, then at t = 1 s (both still decoding, adapter a's
# pages loaded on worker 0) a short one of adapter a.
HOLDER = [req(0.0, "a"), req(0.001, "b"), req(1.0, "a", output_len=10)]


def test_the_policies_are_the_daemons():
    assert tuple(_native.PLACEMENTS) == POLICIES


def test_each_policy_places_deterministically():
    # first fit fills worker 0 first; least-loaded spreads; caraserve sends the third request to
    # the worker already serving its adapter (no 66 ms disk read, no added rank) though it is busier.
    assert workers_of(HOLDER, "first-fit") == [0, 0, 0]
    assert workers_of(HOLDER, "least-loaded") == [0, 1, 2]
    assert workers_of(HOLDER, "caraserve") == [0, 1, 0]
    random = workers_of(HOLDER, "random")
    assert random == workers_of(HOLDER, "random") and set(random) <= {0, 1, 2}
    burst = [req(0.0, None, output_len=50) for _ in range(6)]
    assert workers_of(burst, "least-loaded") == [0, 1, 2, 0, 1, 2]
    # The default is least-loaded, the simulator's rule before placement.
    assert sim.replay(from_requests(HOLDER, VARIANTS), workers=3).worker_of.tolist() == [0, 1, 2]


def test_first_fit_moves_on_where_the_tpot_slo_would_break():
    # The bundled H200 model's step: 4.622 ms + 43 µs per request; a 4.7 ms SLO keeps one request
    # per worker (4.666 ms), not two (4.709 ms).
    burst = [req(0.0, None, output_len=50) for _ in range(3)]
    assert workers_of(burst, "first-fit") == [0, 0, 0]
    assert workers_of(burst, "first-fit", slo_tpot_s=0.0047) == [0, 1, 2]


def test_an_unknown_policy_is_refused_by_name(tmp_path, capsys):
    trace = from_requests(HOLDER, VARIANTS)
    with pytest.raises(ValueError, match="placement must be one of caraserve, least-loaded, first-fit, random"):
        sim.replay(trace, workers=3, placement="round-robin")
    with pytest.raises(ValueError, match="tpot_slo_s"):
        sim.replay(trace, workers=3, slo_tpot_s=-1.0)
    path = tmp_path / "t.jsonl"
    lines = [{"trace": {"kind": "test", "variants": VARIANTS}}, *HOLDER]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with pytest.raises(SystemExit):
        main(["replay", "--trace", str(path), "--placement", "round-robin"])
    assert "invalid choice: 'round-robin'" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(["replay", "--trace", str(path), "--workers", "3", "--placement", "caraserve", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["placement"] == "caraserve"
