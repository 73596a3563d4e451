"""Cross-language wire contract: golden frames written by Rust decode and re-encode byte-identically
in the generated Python mirror (``deltaserve.wire``), and both sides compute the same schema hash.

The golden files come from ``cargo test -p deltaserve-ipc --test golden`` (values in
``router/crates/ipc/src/examples.rs``).
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from deltaserve import _native, wire

GOLDEN = Path(__file__).parents[1] / "golden"
FRAMES = sorted(GOLDEN.glob("*.msgpack"))


def test_one_golden_frame_per_message_kind() -> None:
    names = {p.stem for p in FRAMES}
    assert names == {cls.__name__ for cls in wire._BY_KIND.values()}


@pytest.mark.parametrize("path", FRAMES, ids=[p.stem for p in FRAMES])
def test_golden_frame_round_trips_byte_identically(path: Path) -> None:
    data = path.read_bytes()
    msg = wire.decode(data)
    assert type(msg).__name__ == path.stem
    assert data[:2] == bytes([0x92, type(msg).KIND])
    assert wire.encode(msg) == data
    assert wire.decode(wire.encode(msg)) == msg


def test_schema_hash_agrees_everywhere() -> None:
    golden = (GOLDEN / "schema_hash.txt").read_text().strip()
    assert wire.SCHEMA_HASH == golden == _native.schema_hash()
    assert wire.SCHEMA_TEXT == _native.schema_text()
    # The mirror really computes its hash: the function is FNV-1a 64 (reference vectors).
    assert wire._fnv1a64("") == "cbf29ce484222325"
    assert wire._fnv1a64("foobar") == "85944171f73967e8"


def test_golden_values_decode_into_the_right_fields() -> None:
    plan = wire.decode((GOLDEN / "StepPlan.msgpack").read_bytes())
    assert isinstance(plan, wire.StepPlan)
    assert plan.step_id == 12_345_678_901
    first, greedy = plan.new_requests
    assert first.req_id == 1 << 40
    assert first.token_ids == [1, 127, 128, 255, 256, 65_535, 65_536, 151_643]
    assert len(first.block_ids) == 20
    assert first.sampling == wire.SamplingParams(
        temperature=0.7,
        top_p=0.95,
        top_k=50,
        seed=(1 << 63) + 5,
        logprobs=5,
        logit_bias=[wire.LogitBias(token_id=50256, bias=-100.0)],
        penalties=wire.Penalties(presence=0.5, frequency=-0.25, repetition=1.1),
        min_tokens=4,
        min_tokens_banned=[2, 50256],
        prompt_logprobs=2,
        grammar='{"grammars": [{"json_schema": {"type": "object"}}]}',
    )
    assert greedy.sampling.seed is None and greedy.sampling.logprobs is None and greedy.sampling.grammar is None
    assert plan.running[1] == wire.RunningRequest(
        req_id=2**64 - 1, num_scheduled_tokens=512, new_block_ids=[70_000, 70_001]
    )
    assert plan.released == [2, 1 << 33]
    assert [op.op.label for op in plan.adapter_ops] == ["drop_gpu", "to_host", "to_gpu", "to_gpu", "drop_host"]
    assert [op.kind.label for op in plan.adapter_ops] == ["lora", "lora", "lora", "delta", "delta"]
    assert plan.adapter_ops[1].path == "/srv/adapters/sql-助手"
    assert plan.adapter_ops[2].block_ids == [65_535, 12, 70_002]
    assert plan.adapter_ops[3] == wire.VariantOp(
        adapter_id=4_000_000_000, op=wire.TierOp.TO_GPU, kind=wire.VariantKind.DELTA, slot=63
    )
    assert [op.slot for op in plan.adapter_ops] == [None, None, None, 63, None]

    inspect = wire.decode((GOLDEN / "InspectVariant.msgpack").read_bytes())
    assert inspect == wire.InspectVariant(inspect_id=77, path="/srv/adapters/sql-助手", kind=wire.VariantKind.LORA)
    info = wire.decode((GOLDEN / "VariantInfo.msgpack").read_bytes())
    assert info.error is None and info.num_blocks == 300 and info.host_bytes == 80 << 20
    assert info.kind is wire.VariantKind.LORA
    assert info.target_modules == ["q_proj", "v_proj"]

    out = wire.decode((GOLDEN / "StepOutput.msgpack").read_bytes())
    assert isinstance(out, wire.StepOutput)
    assert out.adapter_host_bytes == 3 << 30
    assert out.host_ready == [7, 4_000_000_000]
    assert out.outputs[0].top_logprobs[1] == wire.TokenLogprob(token_id=13, logprob=-1.7)
    assert out.outputs[2].token_id is None and out.outputs[2].logprob is None
    assert out.outputs[0].prompt_logprobs == [
        wire.PromptLogprob(position=1, logprob=-3.5, top_logprobs=[wire.TokenLogprob(token_id=9, logprob=-0.5)])
    ]
    assert out.timing == wire.StepTiming(gap_us=87, forward_us=12_345, total_us=70_000, floor_us=9_876, busy_us=52_000)
    assert out.failed_variants == [
        wire.FailedVariant(variant_id=9, message="its files could not be loaded (AdapterLoadError)")
    ]
    assert out.refused_requests == [
        wire.RefusedRequest(req_id=11, message="response_format: Pointer '/nope' does not exist")
    ]
    assert out.gpu_ready == [12, 3_000_000_000]

    hello = wire.decode((GOLDEN / "Hello.msgpack").read_bytes())
    assert isinstance(hello, wire.Hello)
    assert hello.schema_hash == wire.SCHEMA_HASH
    assert hello.model.architecture == "LlamaForCausalLM" and hello.kv.bytes_per_block == 5_000_000_000

    shutdown = wire.decode((GOLDEN / "Shutdown.msgpack").read_bytes())
    assert shutdown == wire.Shutdown(reason="router stopping — 再见 👋")

    err = wire.decode((GOLDEN / "WorkerError.msgpack").read_bytes())
    assert isinstance(err, wire.WorkerError)
    assert not err.fatal and len(err.req_ids) == 20 and "«zh-助手»" in err.message


def test_truncated_field_lists_take_defaults() -> None:
    # An older peer's WorkerError without `fatal` and `req_ids`.
    err = wire.decode(msgpack.packb([5, [9, "x"]], use_bin_type=True))
    assert err == wire.WorkerError(step_id=9, message="x", fatal=False, req_ids=[])

    req = wire.NewRequest.from_wire([5, [1, 2]])
    assert req.req_id == 5 and req.token_ids == [1, 2]
    assert req.block_ids == [] and req.sampling == wire.SamplingParams()
    # Defaults are fresh objects, never shared between instances.
    other = wire.NewRequest.from_wire([])
    assert other.block_ids is not req.block_ids and other.sampling is not req.sampling

    assert wire.StepPlan.from_wire([]) == wire.StepPlan()
    assert wire.decode(wire.encode(wire.StepPlan())) == wire.StepPlan()


def test_enums_are_generated_with_the_rust_values_and_labels() -> None:
    assert [(k.name, int(k), k.label) for k in wire.VariantKind] == [("LORA", 0, "lora"), ("DELTA", 1, "delta")]
    assert [op.label for op in wire.TierOp] == ["to_host", "to_gpu", "drop_gpu", "drop_host"]
    assert [int(op) for op in wire.TierOp] == [0, 1, 2, 3]
    assert "VariantKind:u8{lora=0,delta=1}" in wire.SCHEMA_TEXT.split("\n")
    # On the wire an enum is its value; a value no member has does not decode (as in Rust).
    op = wire.VariantOp(adapter_id=3, op=wire.TierOp.DROP_HOST, kind=wire.VariantKind.DELTA)
    assert op.to_wire() == [3, 3, "", [], 1, None]
    assert msgpack.packb(op.to_wire()) == msgpack.packb([3, 3, "", [], 1, None])
    decoded = wire.VariantOp.from_wire([3, 3, "", [], 1, None])
    assert decoded == op and decoded.op is wire.TierOp.DROP_HOST and decoded.kind is wire.VariantKind.DELTA
    with pytest.raises(ValueError, match="cannot decode StepPlan body"):
        wire.decode(msgpack.packb([2, [1, [], [], [], [[3, 9, "", [], 0, None]]]]))


def test_extra_trailing_fields_are_ignored() -> None:
    assert wire.TokenLogprob.from_wire([3, -0.5, "from a newer peer"]) == wire.TokenLogprob(token_id=3, logprob=-0.5)


def test_floats_always_encode_as_float64() -> None:
    # An int stored in a float field must still produce Rust's bytes (0xcb float64).
    as_int = wire.encode(
        wire.StepOutput(outputs=[wire.RequestOutput(logprob=0, top_logprobs=[wire.TokenLogprob(logprob=-1)])])
    )
    as_float = wire.encode(
        wire.StepOutput(outputs=[wire.RequestOutput(logprob=0.0, top_logprobs=[wire.TokenLogprob(logprob=-1.0)])])
    )
    assert as_int == as_float
    assert as_float.count(b"\xcb") == 2


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"", "not one msgpack value"),
        (b"\xc1", "not one msgpack value"),
        (msgpack.packb([4, ["a"]]) + b"\x00", "not one msgpack value"),
        (msgpack.packb(42), "expected a msgpack array"),
        (msgpack.packb([2, [], 3]), "expected a msgpack array"),
        (msgpack.packb([9, []]), "unknown message kind 9"),
        (msgpack.packb(["StepPlan", []]), "unknown message kind 'StepPlan'"),
        (msgpack.packb([2, "body"]), "body is str"),
        (msgpack.packb([2, [1, [5]]]), "cannot decode StepPlan body"),
        (msgpack.packb([3, [1, [], 7]]), "cannot decode StepOutput body"),
    ],
)
def test_bad_frames_raise_value_error(frame: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wire.decode(frame)
