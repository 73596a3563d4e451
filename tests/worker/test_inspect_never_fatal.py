"""An inspection that raises (any exception, whatever a directory holds) is a refusal of that
directory, answered in order, and the worker serves on (issue 28: a crafted adapter config made
``InspectVariant`` raise past the loop and restart the worker)."""

from __future__ import annotations

from deltaserve import wire
from deltaserve.worker.loop import WorkerLoop
from worker.test_executor import FakeLink


class RaisingExecutor:
    """Answers Hello; every inspection raises what a crafted file made PEFT-parsing code raise."""

    def hello(self, schema_hash: str) -> wire.Hello:
        return wire.Hello(schema_hash=schema_hash)

    def inspect_variant(self, path: str, kind: wire.VariantKind) -> wire.VariantInfo:
        raise TypeError(f"'int' object is not iterable (in {path}/adapter_config.json)")


def test_a_raising_inspection_is_a_refusal_and_the_worker_serves_on() -> None:
    frames = [
        wire.InspectVariant(inspect_id=7, path="/srv/secret/adapter"),
        wire.InspectVariant(inspect_id=8, path="/srv/other"),
        wire.Shutdown(reason="test"),
    ]
    link = FakeLink([wire.encode(f) for f in frames])
    assert WorkerLoop(RaisingExecutor(), link).run() == 0  # type: ignore[arg-type]
    _, first, second = link.sent
    for info, inspect_id in ((first, 7), (second, 8)):
        assert isinstance(info, wire.VariantInfo) and info.inspect_id == inspect_id
        assert info.error is not None and "TypeError" in info.error
        assert "/srv" not in info.error and "Traceback" not in info.error  # paths and traces: log only
