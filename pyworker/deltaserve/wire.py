"""Python mirror of the wire schema owned by the Rust ``ipc`` crate (``router/crates/ipc/src/wire.rs``).

GENERATED FILE, DO NOT EDIT. Regenerate with::

    cargo run -p deltaserve-ipc --bin ipc-schema -- gen-py

A Rust test fails when this file is stale, and ``tests/test_wire_golden.py`` decodes and re-encodes
the golden frames written by Rust byte-identically.

Framing: a frame is the msgpack 2-array ``[KIND, body]``; ``body`` is the struct's fields as a
positional array in declaration order (nested structs are nested arrays). Evolution is
append-only: fields missing at the end of a body take their defaults, extra trailing fields from a
newer peer are ignored. ``SCHEMA_HASH`` is computed here from ``SCHEMA_TEXT`` at import, so a stale
mirror announces a hash the router refuses.

Messages: StepPlan=2, StepOutput=3, Hello=1, InspectVariant=6, VariantInfo=7, WorkerConfig=8, Shutdown=4, WorkerError=5.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Optional, Union

import msgpack

__all__ = [
    "SCHEMA_TEXT",
    "SCHEMA_HASH",
    "VariantKind",
    "TierOp",
    "KernelBackend",
    "LogitBias",
    "Penalties",
    "SamplingParams",
    "NewRequest",
    "RunningRequest",
    "VariantOp",
    "StepPlan",
    "TokenLogprob",
    "PromptLogprob",
    "RequestOutput",
    "StepTiming",
    "FailedVariant",
    "RefusedRequest",
    "StepOutput",
    "ModelInfo",
    "KvCapacity",
    "Hello",
    "InspectVariant",
    "VariantInfo",
    "WorkerConfig",
    "Shutdown",
    "WorkerError",
    "Message",
    "encode",
    "decode",
]

#: Canonical schema text, identical to Rust's `ipc::schema::schema_text()`.
SCHEMA_TEXT = (
    "LogitBias=0{token_id:u32,bias:f64}\n"
    "Penalties=0{presence:f64,frequency:f64,repetition:f64}\n"
    "SamplingParams=0{temperature:f64,top_p:f64,top_k:u32,seed:Option<u64>,logprobs:Option<u32>,logit_bias:Vec<LogitBias>,penalties:Option<Penalties>,min_tokens:u32,min_tokens_banned:Vec<u32>,prompt_logprobs:Option<u32>,grammar:Option<String>}\n"
    "NewRequest=0{req_id:u64,token_ids:Vec<u32>,num_prompt_tokens:u32,num_computed_tokens:u32,num_scheduled_tokens:u32,block_ids:Vec<u32>,sampling:SamplingParams,adapter_id:u32}\n"
    "RunningRequest=0{req_id:u64,num_scheduled_tokens:u32,new_block_ids:Vec<u32>}\n"
    "VariantOp=0{adapter_id:u32,op:TierOp,path:String,block_ids:Vec<u32>,kind:VariantKind,slot:Option<u32>}\n"
    "StepPlan=2{step_id:u64,new_requests:Vec<NewRequest>,running:Vec<RunningRequest>,released:Vec<u64>,adapter_ops:Vec<VariantOp>}\n"
    "TokenLogprob=0{token_id:u32,logprob:f64}\n"
    "PromptLogprob=0{position:u32,logprob:f64,top_logprobs:Vec<TokenLogprob>}\n"
    "RequestOutput=0{req_id:u64,token_id:Option<u32>,logprob:Option<f64>,top_logprobs:Vec<TokenLogprob>,prompt_logprobs:Vec<PromptLogprob>}\n"
    "StepTiming=0{gap_us:u64,forward_us:u64,total_us:u64,floor_us:u64,busy_us:u64}\n"
    "FailedVariant=0{variant_id:u32,message:String}\n"
    "RefusedRequest=0{req_id:u64,message:String}\n"
    "StepOutput=3{step_id:u64,outputs:Vec<RequestOutput>,timing:StepTiming,adapter_host_bytes:u64,host_ready:Vec<u32>,cpu_assisted_prefills:u32,cpu_assist_fallbacks:u32,cpu_assist_declined:u32,speculated_prefills:u32,speculation_accepted:u32,speculation_recomputed_layers:u32,failed_variants:Vec<FailedVariant>,refused_requests:Vec<RefusedRequest>,gpu_ready:Vec<u32>}\n"
    "ModelInfo=0{architecture:String,vocab_size:u32,max_model_len:u32,num_layers:u32,hidden_size:u32,eos_token_ids:Vec<u32>,dtype:String,device:String,num_params:u64}\n"
    "KvCapacity=0{block_size:u32,num_blocks:u32,bytes_per_block:u64}\n"
    "Hello=1{schema_hash:String,pid:u32,model:ModelInfo,kv:KvCapacity,delta_graph_tokens:u32}\n"
    "InspectVariant=6{inspect_id:u64,path:String,kind:VariantKind}\n"
    "VariantInfo=7{inspect_id:u64,error:Option<String>,num_blocks:u32,host_bytes:u64,max_rank:u32,target_modules:Vec<String>,kind:VariantKind,summary:String}\n"
    "WorkerConfig=8{schema_hash:String,model_dir:String,device:String,dtype:String,block_size:u32,kv_cache_bytes:u64,gpu_memory_utilization:f64,max_num_batched_tokens:u32,max_model_len:Option<u32>,seed:u64,kernels:KernelBackend,cuda_graph_max_batch:u32,recv_spin_us:u32,num_threads:u32,log_level:String,max_lora_rank:u32,max_loras_per_step:u32,host_arena_bytes:u64,max_deltas:u32,cuda_ops:bool,cache_dir:Option<String>,profile_path:Option<String>,profile_every_s:f64,cpu_lora_helpers:u32,cpu_lora_policy:String}\n"
    "Shutdown=4{reason:String}\n"
    "WorkerError=5{step_id:u64,message:String,fatal:bool,req_ids:Vec<u64>}\n"
    "VariantKind:u8{lora=0,delta=1}\n"
    "TierOp:u8{to_host=0,to_gpu=1,drop_gpu=2,drop_host=3}\n"
    "KernelBackend:u8{auto=0,torch=1,triton=2}"
)


def _fnv1a64(text: str) -> str:
    """FNV-1a 64-bit hash of ``text``'s UTF-8 bytes as 16 lowercase hex digits (same as Rust)."""
    h = 0xCBF29CE484222325
    for b in text.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


#: Hash of ``SCHEMA_TEXT``, computed here; the worker sends it in ``Hello``.
SCHEMA_HASH: str = _fnv1a64(SCHEMA_TEXT)



class VariantKind(IntEnum):
    """The kinds of variant a request may run with besides the base model. They share the adapter
    id space and the tier ops; they differ in where a GPU copy lives.
    """

    #: A PEFT LoRA adapter: `num_blocks` pages of the KV pool while GPU-resident (S-LoRA).
    LORA = 0
    #: A compressed full fine-tune (DeltaZip, `deltaserve compress`): one of the worker's
    #: `--max-deltas` delta slots while GPU-resident, no pool pages.
    DELTA = 1

    @property
    def label(self) -> str:
        """The lower-case label logs, errors and the HTTP API show (Rust's ``label()``)."""
        return self.name.lower()


class TierOp(IntEnum):
    """One move of a variant between tiers (S-LoRA's tiers: disk -> host memory -> GPU). The
    state machine is the scheduler's (`router/crates/sched/src/variants.rs` draws it).
    """

    #: Read and validate `VariantOp::path` into host memory (the worker may do it in the
    #: background; a later `to_gpu` waits for it).
    TO_HOST = 0
    #: Copy the host copy to the GPU: into `block_ids` of the pool (a LoRA adapter), or into
    #: delta slot `slot` (a delta).
    TO_GPU = 1
    #: Forget the GPU placement (a LoRA adapter's pages already belong to the router again;
    #: a delta's slot is free).
    DROP_GPU = 2
    #: Free the host copy (a GPU copy stays valid without it).
    DROP_HOST = 3

    @property
    def label(self) -> str:
        """The lower-case label logs, errors and the HTTP API show (Rust's ``label()``)."""
        return self.name.lower()


class KernelBackend(IntEnum):
    """Which implementation of the worker's kernels runs (`WorkerConfig::kernels`)."""

    #: Triton on CUDA, the torch references on the CPU.
    AUTO = 0
    #: The torch references everywhere (A/B runs).
    TORCH = 1
    #: Triton everywhere (on the CPU under `TRITON_INTERPRET=1`).
    TRITON = 2

    @property
    def label(self) -> str:
        """The lower-case label logs, errors and the HTTP API show (Rust's ``label()``)."""
        return self.name.lower()


@dataclass(slots=True)
class LogitBias:
    """One entry of `SamplingParams::logit_bias`."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    token_id: int = 0
    #: Added to the token's logit, in [-100, 100].
    bias: float = 0.0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.token_id, float(self.bias)]

    @classmethod
    def from_wire(cls, a: list) -> LogitBias:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 2:
            return cls(a[0], a[1])
        m = cls()
        if n > 0:
            m.token_id = a[0]
        if n > 1:
            m.bias = a[1]
        return m


@dataclass(slots=True)
class Penalties:
    """Penalties over a request's tokens (`SamplingParams::penalties`); each is off at its
    neutral value.
    """

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: OpenAI's `presence_penalty` in [-2, 2]: subtracted from the logit of every token
    #: generated at least once so far (0: off).
    presence: float = 0.0
    #: OpenAI's `frequency_penalty` in [-2, 2]: subtracted once per time the token was
    #: generated so far (0: off).
    frequency: float = 0.0
    #: vLLM / transformers' `repetition_penalty` (> 0): a token of the prompt or the output so
    #: far has its logit divided by it when positive, multiplied when not (1: off).
    repetition: float = 0.0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [float(self.presence), float(self.frequency), float(self.repetition)]

    @classmethod
    def from_wire(cls, a: list) -> Penalties:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 3:
            return cls(a[0], a[1], a[2])
        m = cls()
        if n > 0:
            m.presence = a[0]
        if n > 1:
            m.frequency = a[1]
        if n > 2:
            m.repetition = a[2]
        return m


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next token of one request. `temperature == 0` means greedy."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: Softmax temperature; 0 selects the arg-max token (greedy).
    temperature: float = 0.0
    #: Nucleus sampling mass in (0, 1]; 1 disables it.
    top_p: float = 0.0
    #: Keep only the k most likely tokens; 0 disables it.
    top_k: int = 0
    #: Per-request seed: the draw for output token i uses a generator seeded from (seed, i),
    #: so a seeded request samples the same tokens whatever else is in its batch.
    seed: Optional[int] = None
    #: Return the sampled token's logprob plus this many top alternatives; `None` for none.
    logprobs: Optional[int] = None
    #: Added to the logits before sampling, greedy included (OpenAI's `logit_bias`); empty
    #: for none. Token ids are below the vocabulary size (checked by the router).
    logit_bias: list[LogitBias] = field(default_factory=list)
    #: Presence, frequency and repetition penalties; `None` when all are off (the common
    #: case costs one byte).
    penalties: Optional[Penalties] = None
    #: vLLM's `min_tokens`: while fewer output tokens than this exist, none of
    #: `min_tokens_banned` can be sampled.
    min_tokens: int = 0
    #: The tokens that would end the request (its EOS ids unless `ignore_eos`, plus its
    #: `stop_token_ids`), banned for output tokens below `min_tokens`; empty when
    #: `min_tokens` is 0.
    min_tokens_banned: list[int] = field(default_factory=list)
    #: `echo` with logprobs: the prompt tokens' logprobs (each given the tokens before it),
    #: plus this many top alternatives, in `RequestOutput::prompt_logprobs`; `None` for none
    #: (the worker then computes logits only where it samples).
    prompt_logprobs: Optional[int] = None
    #: Structured output (`response_format`, `tools`): an llguidance grammar (its JSON form,
    #: e.g. `{"grammars": [{"json_schema": {...}}]}`) every output token must follow; the
    #: worker masks the logits with it and, once it is complete, allows only EOS. `None` for
    #: unconstrained requests. A grammar the worker cannot compile refuses the request
    #: (`StepOutput::refused_requests`).
    grammar: Optional[str] = None

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [float(self.temperature), float(self.top_p), self.top_k, self.seed, self.logprobs, [x0.to_wire() for x0 in self.logit_bias], (None if self.penalties is None else self.penalties.to_wire()), self.min_tokens, self.min_tokens_banned, self.prompt_logprobs, self.grammar]

    @classmethod
    def from_wire(cls, a: list) -> SamplingParams:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 11:
            return cls(a[0], a[1], a[2], a[3], a[4], [LogitBias.from_wire(x0) for x0 in a[5]], (None if a[6] is None else Penalties.from_wire(a[6])), a[7], a[8], a[9], a[10])
        m = cls()
        if n > 0:
            m.temperature = a[0]
        if n > 1:
            m.top_p = a[1]
        if n > 2:
            m.top_k = a[2]
        if n > 3:
            m.seed = a[3]
        if n > 4:
            m.logprobs = a[4]
        if n > 5:
            m.logit_bias = [LogitBias.from_wire(x0) for x0 in a[5]]
        if n > 6:
            m.penalties = (None if a[6] is None else Penalties.from_wire(a[6]))
        if n > 7:
            m.min_tokens = a[7]
        if n > 8:
            m.min_tokens_banned = a[8]
        if n > 9:
            m.prompt_logprobs = a[9]
        if n > 10:
            m.grammar = a[10]
        return m


@dataclass(slots=True)
class NewRequest:
    """A request the worker has not seen (or has released, e.g. after preemption): sent in full."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: Router-assigned id, unique for the life of the router.
    req_id: int = 0
    #: Every token known so far: the prompt, plus tokens generated before a preemption.
    token_ids: list[int] = field(default_factory=list)
    #: Number of the original prompt's tokens at the front of `token_ids`; output token i is
    #: `token_ids[num_prompt_tokens + i]`, which seeds the sampler deterministically.
    num_prompt_tokens: int = 0
    #: Leading tokens whose KV is already in the cache (0 unless a prefix was shared).
    num_computed_tokens: int = 0
    #: Tokens to compute this step, starting at `num_computed_tokens` (a prefill chunk).
    num_scheduled_tokens: int = 0
    #: KV pages, in order, that hold this request's tokens.
    block_ids: list[int] = field(default_factory=list)
    #: How to sample once the whole sequence is computed.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: The variant (LoRA adapter or delta) this request's tokens run with: one GPU-resident
    #: once this step's `adapter_ops` are applied (see `VariantOp`), 0 for the base model alone.
    adapter_id: int = 0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.req_id, self.token_ids, self.num_prompt_tokens, self.num_computed_tokens, self.num_scheduled_tokens, self.block_ids, self.sampling.to_wire(), self.adapter_id]

    @classmethod
    def from_wire(cls, a: list) -> NewRequest:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 8:
            return cls(a[0], a[1], a[2], a[3], a[4], a[5], SamplingParams.from_wire(a[6]), a[7])
        m = cls()
        if n > 0:
            m.req_id = a[0]
        if n > 1:
            m.token_ids = a[1]
        if n > 2:
            m.num_prompt_tokens = a[2]
        if n > 3:
            m.num_computed_tokens = a[3]
        if n > 4:
            m.num_scheduled_tokens = a[4]
        if n > 5:
            m.block_ids = a[5]
        if n > 6:
            m.sampling = SamplingParams.from_wire(a[6])
        if n > 7:
            m.adapter_id = a[7]
        return m


@dataclass(slots=True)
class RunningRequest:
    """A request already on the worker: only what changed since the last step."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: The request's id.
    req_id: int = 0
    #: Tokens to compute this step: 1 in decode (the token sampled last step), more while a
    #: chunked prefill continues.
    num_scheduled_tokens: int = 0
    #: KV pages appended to the request's block table this step.
    new_block_ids: list[int] = field(default_factory=list)

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.req_id, self.num_scheduled_tokens, self.new_block_ids]

    @classmethod
    def from_wire(cls, a: list) -> RunningRequest:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 3:
            return cls(a[0], a[1], a[2])
        m = cls()
        if n > 0:
            m.req_id = a[0]
        if n > 1:
            m.num_scheduled_tokens = a[1]
        if n > 2:
            m.new_block_ids = a[2]
        return m


@dataclass(slots=True)
class VariantOp:
    """One change to where a variant's weights live (`TierOp`). The router decides every one,
    including where on the GPU; the worker applies a plan's ops in order, after `released` and
    before the plan's requests run, each with the pool of its `kind`.
    """

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: The variant (router-assigned, > 0; requests name it in `NewRequest::adapter_id`).
    adapter_id: int = 0
    #: The move.
    op: TierOp = TierOp.TO_HOST
    #: The PEFT or delta directory (`to_host`).
    path: str = ""
    #: Pool pages that hold a LoRA adapter, in order (`to_gpu` of a LoRA adapter); the same
    #: page ids as KV pages. Empty for a delta.
    block_ids: list[int] = field(default_factory=list)
    #: The variant's kind: which of the worker's pools applies the op (the router knows it
    #: from registration; the worker never guesses it from the files).
    kind: VariantKind = VariantKind.LORA
    #: The delta slot, in `0..max_deltas`, a delta's `to_gpu` fills (the router picks it; a
    #: slot taken on the worker is refused). `None` for every other op.
    slot: Optional[int] = None

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.adapter_id, self.op, self.path, self.block_ids, self.kind, self.slot]

    @classmethod
    def from_wire(cls, a: list) -> VariantOp:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 6:
            return cls(a[0], TierOp(a[1]), a[2], a[3], VariantKind(a[4]), a[5])
        m = cls()
        if n > 0:
            m.adapter_id = a[0]
        if n > 1:
            m.op = TierOp(a[1])
        if n > 2:
            m.path = a[2]
        if n > 3:
            m.block_ids = a[3]
        if n > 4:
            m.kind = VariantKind(a[4])
        if n > 5:
            m.slot = a[5]
        return m


@dataclass(slots=True)
class StepPlan:
    """One iteration of continuous batching, decided by the router's scheduler."""

    KIND: ClassVar[int] = 2  # frame kind

    #: Monotonic step number; the worker echoes it in its `StepOutput`.
    step_id: int = 0
    #: Requests sent in full (first time on the worker, or resumed after preemption).
    new_requests: list[NewRequest] = field(default_factory=list)
    #: Requests continuing from an earlier step, as diffs.
    running: list[RunningRequest] = field(default_factory=list)
    #: Requests whose worker-side state must be dropped before this step (finished, aborted or
    #: preempted); their KV pages already belong to the router again.
    released: list[int] = field(default_factory=list)
    #: Adapter tier changes, applied in order after `released` and before the requests.
    adapter_ops: list[VariantOp] = field(default_factory=list)

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.step_id, [x0.to_wire() for x0 in self.new_requests], [x0.to_wire() for x0 in self.running], self.released, [x0.to_wire() for x0 in self.adapter_ops]]

    @classmethod
    def from_wire(cls, a: list) -> StepPlan:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 5:
            return cls(a[0], [NewRequest.from_wire(x0) for x0 in a[1]], [RunningRequest.from_wire(x0) for x0 in a[2]], a[3], [VariantOp.from_wire(x0) for x0 in a[4]])
        m = cls()
        if n > 0:
            m.step_id = a[0]
        if n > 1:
            m.new_requests = [NewRequest.from_wire(x0) for x0 in a[1]]
        if n > 2:
            m.running = [RunningRequest.from_wire(x0) for x0 in a[2]]
        if n > 3:
            m.released = a[3]
        if n > 4:
            m.adapter_ops = [VariantOp.from_wire(x0) for x0 in a[4]]
        return m


@dataclass(slots=True)
class TokenLogprob:
    """One alternative token with its log-probability."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    token_id: int = 0
    logprob: float = 0.0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.token_id, float(self.logprob)]

    @classmethod
    def from_wire(cls, a: list) -> TokenLogprob:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 2:
            return cls(a[0], a[1])
        m = cls()
        if n > 0:
            m.token_id = a[0]
        if n > 1:
            m.logprob = a[1]
        return m


@dataclass(slots=True)
class PromptLogprob:
    """The logprob of one prompt token given the tokens before it (`echo` with logprobs)."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: The token's position in the prompt (at least 1: the first token has none).
    position: int = 0
    #: Its log-probability under the model's unmodified distribution.
    logprob: float = 0.0
    #: The most likely tokens at that position, most likely first.
    top_logprobs: list[TokenLogprob] = field(default_factory=list)

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.position, float(self.logprob), [x0.to_wire() for x0 in self.top_logprobs]]

    @classmethod
    def from_wire(cls, a: list) -> PromptLogprob:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 3:
            return cls(a[0], a[1], [TokenLogprob.from_wire(x0) for x0 in a[2]])
        m = cls()
        if n > 0:
            m.position = a[0]
        if n > 1:
            m.logprob = a[1]
        if n > 2:
            m.top_logprobs = [TokenLogprob.from_wire(x0) for x0 in a[2]]
        return m


@dataclass(slots=True)
class RequestOutput:
    """What one scheduled request produced in a step."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: The request's id.
    req_id: int = 0
    #: The sampled token; `None` when the step computed only part of a chunked prefill.
    token_id: Optional[int] = None
    #: Log-probability of `token_id` (only when the request asked for logprobs).
    logprob: Optional[float] = None
    #: The most likely alternatives, most likely first (only when asked for).
    top_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: With `SamplingParams::prompt_logprobs`: the prompt tokens this step's chunk gave
    #: logits for (positions `computed + 1 ..= computed + chunk`, within the prompt); a
    #: preempted request recomputed from the start sends them again (the router keeps the
    #: first).
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.req_id, self.token_id, (None if self.logprob is None else float(self.logprob)), [x0.to_wire() for x0 in self.top_logprobs], [x0.to_wire() for x0 in self.prompt_logprobs]]

    @classmethod
    def from_wire(cls, a: list) -> RequestOutput:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 5:
            return cls(a[0], a[1], a[2], [TokenLogprob.from_wire(x0) for x0 in a[3]], [PromptLogprob.from_wire(x0) for x0 in a[4]])
        m = cls()
        if n > 0:
            m.req_id = a[0]
        if n > 1:
            m.token_id = a[1]
        if n > 2:
            m.logprob = a[2]
        if n > 3:
            m.top_logprobs = [TokenLogprob.from_wire(x0) for x0 in a[3]]
        if n > 4:
            m.prompt_logprobs = [PromptLogprob.from_wire(x0) for x0 in a[4]]
        return m


@dataclass(slots=True)
class StepTiming:
    """Where a step's time went, measured on the worker's monotonic clock."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: From the previous `StepOutput` being written to this plan being decoded: the router's
    #: scheduling plus both IPC hops. This is the overhead the router is judged on.
    gap_us: int = 0
    #: The model forward pass and sampling.
    forward_us: int = 0
    #: From this plan being decoded to its output being encoded.
    total_us: int = 0
    #: The step's floor: the least time the device could take for what it ran, the larger of
    #: (bytes read: base weights once, the KV its requests attend over, its variants' weights)
    #: ÷ measured copy bandwidth and its FLOPs ÷ measured matmul peak (the worker's
    #: `step_floor.py`); 0 for an empty step.
    floor_us: int = 0
    #: The worker's time on this step alone: from the later of this plan being decoded and
    #: the previous step's output being encoded, to this output being encoded. A step launched
    #: behind the one in flight counts that wait in `total_us` but not here, so summed over
    #: steps this is the worker's busy time, overlapped or not; `busy_us / floor_us` summed is
    #: the served-step efficiency.
    busy_us: int = 0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.gap_us, self.forward_us, self.total_us, self.floor_us, self.busy_us]

    @classmethod
    def from_wire(cls, a: list) -> StepTiming:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 5:
            return cls(a[0], a[1], a[2], a[3], a[4])
        m = cls()
        if n > 0:
            m.gap_us = a[0]
        if n > 1:
            m.forward_us = a[1]
        if n > 2:
            m.total_us = a[2]
        if n > 3:
            m.floor_us = a[3]
        if n > 4:
            m.busy_us = a[4]
        return m


@dataclass(slots=True)
class FailedVariant:
    """A variant whose files failed after registration (its host read failed at the `to_gpu`
    that needed it): the worker quarantined it, dropped its requests from its steps and
    skips its ops; the router fails its requests and marks it unavailable.
    """

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: The variant (`VariantOp::adapter_id`).
    variant_id: int = 0
    #: What failed, for the requests' error events (no traceback, no server path).
    message: str = ""

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.variant_id, self.message]

    @classmethod
    def from_wire(cls, a: list) -> FailedVariant:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 2:
            return cls(a[0], a[1])
        m = cls()
        if n > 0:
            m.variant_id = a[0]
        if n > 1:
            m.message = a[1]
        return m


@dataclass(slots=True)
class RefusedRequest:
    """A new request the worker refused at admission (its grammar does not compile): it left
    the step with no output; the router fails it with the message (a client error).
    """

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: The request (`NewRequest::req_id`).
    req_id: int = 0
    #: Why, for the client (e.g. the JSON schema's error; no traceback, no server path).
    message: str = ""

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.req_id, self.message]

    @classmethod
    def from_wire(cls, a: list) -> RefusedRequest:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 2:
            return cls(a[0], a[1])
        m = cls()
        if n > 0:
            m.req_id = a[0]
        if n > 1:
            m.message = a[1]
        return m


@dataclass(slots=True)
class StepOutput:
    """The worker's answer to one `StepPlan`."""

    KIND: ClassVar[int] = 3  # frame kind

    #: The plan's `step_id`.
    step_id: int = 0
    #: One entry per scheduled request, in no particular order.
    outputs: list[RequestOutput] = field(default_factory=list)
    #: Timing of this step.
    timing: StepTiming = field(default_factory=StepTiming)
    #: Bytes of adapter weights the worker holds in host memory after this step (its measured
    #: host tier, which the router's accounting keeps under the configured budget).
    adapter_host_bytes: int = 0
    #: Variants (LoRA adapters and deltas) whose `to_host` read finished since the previous
    #: `StepOutput`, well or not (a failed read is reported by the `to_gpu` that needs it).
    #: The router admits requests for a variant whose read is still running only when
    #: nothing else would run, since that step would wait for the read.
    host_ready: list[int] = field(default_factory=list)
    #: Cold prefills (requests) whose LoRA the worker's CPU helpers computed this step while
    #: their adapter's pages loaded (CaraServe's CPU-assisted cold start).
    cpu_assisted_prefills: int = 0
    #: Of those, prefills where a helper failed or stalled: the worker computed its rows
    #: itself (same tokens) and restarts the helper.
    cpu_assist_fallbacks: int = 0
    #: Cold prefills this step the helpers did not take: none free, predicted no faster than
    #: the load, or a one-token prefill.
    cpu_assist_declined: int = 0
    #: Cold delta prefills that ran a surrogate block while the delta loaded (BlockLLM's
    #: speculative execution, `DELTASERVE_BLOCK_SPECULATION`; their tokens stay exact).
    speculated_prefills: int = 0
    #: Of those, the ones whose real block's output had cosine >= 0.95 with the surrogate's.
    speculation_accepted: int = 0
    #: Layers rerun after the speculated blocks, their KV rewritten (summed over prefills).
    speculation_recomputed_layers: int = 0
    #: Variants quarantined since the previous `StepOutput` (each reported once); their
    #: requests in this step have no output.
    failed_variants: list[FailedVariant] = field(default_factory=list)
    #: New requests refused at admission in this step (each reported once); they have no
    #: output and the worker holds no state for them.
    refused_requests: list[RefusedRequest] = field(default_factory=list)
    #: Deltas whose `to_gpu` copy finished on the device since the previous `StepOutput`
    #: (the worker copies a delta beside the steps; a failed load is reported too: the
    #: step that needs it says why). With `gpu_load_reports` the router admits requests for
    #: a delta still being copied only when nothing else would run, since that step would
    #: wait for the copy.
    gpu_ready: list[int] = field(default_factory=list)

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.step_id, [x0.to_wire() for x0 in self.outputs], self.timing.to_wire(), self.adapter_host_bytes, self.host_ready, self.cpu_assisted_prefills, self.cpu_assist_fallbacks, self.cpu_assist_declined, self.speculated_prefills, self.speculation_accepted, self.speculation_recomputed_layers, [x0.to_wire() for x0 in self.failed_variants], [x0.to_wire() for x0 in self.refused_requests], self.gpu_ready]

    @classmethod
    def from_wire(cls, a: list) -> StepOutput:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 14:
            return cls(a[0], [RequestOutput.from_wire(x0) for x0 in a[1]], StepTiming.from_wire(a[2]), a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], [FailedVariant.from_wire(x0) for x0 in a[11]], [RefusedRequest.from_wire(x0) for x0 in a[12]], a[13])
        m = cls()
        if n > 0:
            m.step_id = a[0]
        if n > 1:
            m.outputs = [RequestOutput.from_wire(x0) for x0 in a[1]]
        if n > 2:
            m.timing = StepTiming.from_wire(a[2])
        if n > 3:
            m.adapter_host_bytes = a[3]
        if n > 4:
            m.host_ready = a[4]
        if n > 5:
            m.cpu_assisted_prefills = a[5]
        if n > 6:
            m.cpu_assist_fallbacks = a[6]
        if n > 7:
            m.cpu_assist_declined = a[7]
        if n > 8:
            m.speculated_prefills = a[8]
        if n > 9:
            m.speculation_accepted = a[9]
        if n > 10:
            m.speculation_recomputed_layers = a[10]
        if n > 11:
            m.failed_variants = [FailedVariant.from_wire(x0) for x0 in a[11]]
        if n > 12:
            m.refused_requests = [RefusedRequest.from_wire(x0) for x0 in a[12]]
        if n > 13:
            m.gpu_ready = a[13]
        return m


@dataclass(slots=True)
class ModelInfo:
    """What the router needs to know about the loaded model."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: HF architecture name, e.g. `LlamaForCausalLM`.
    architecture: str = ""
    vocab_size: int = 0
    #: Longest sequence (prompt + output) the model accepts.
    max_model_len: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    #: Tokens that end generation (from `generation_config.json` / `config.json`).
    eos_token_ids: list[int] = field(default_factory=list)
    #: Compute dtype actually used, e.g. `float32`, `bfloat16`.
    dtype: str = ""
    #: Torch device, e.g. `cpu` or `cuda:0`.
    device: str = ""
    num_params: int = 0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.architecture, self.vocab_size, self.max_model_len, self.num_layers, self.hidden_size, self.eos_token_ids, self.dtype, self.device, self.num_params]

    @classmethod
    def from_wire(cls, a: list) -> ModelInfo:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 9:
            return cls(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8])
        m = cls()
        if n > 0:
            m.architecture = a[0]
        if n > 1:
            m.vocab_size = a[1]
        if n > 2:
            m.max_model_len = a[2]
        if n > 3:
            m.num_layers = a[3]
        if n > 4:
            m.hidden_size = a[4]
        if n > 5:
            m.eos_token_ids = a[5]
        if n > 6:
            m.dtype = a[6]
        if n > 7:
            m.device = a[7]
        if n > 8:
            m.num_params = a[8]
        return m


@dataclass(slots=True)
class KvCapacity:
    """The paged KV cache the worker allocated; the router does the accounting over it."""

    KIND: ClassVar[int] = 0  # 0: only ever nested inside a message

    #: Tokens per page.
    block_size: int = 0
    #: Pages in the pool.
    num_blocks: int = 0
    #: Bytes of one page across all layers (K and V).
    bytes_per_block: int = 0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.block_size, self.num_blocks, self.bytes_per_block]

    @classmethod
    def from_wire(cls, a: list) -> KvCapacity:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 3:
            return cls(a[0], a[1], a[2])
        m = cls()
        if n > 0:
            m.block_size = a[0]
        if n > 1:
            m.num_blocks = a[1]
        if n > 2:
            m.bytes_per_block = a[2]
        return m


@dataclass(slots=True)
class Hello:
    """First frame a worker sends, once its model and KV cache are ready."""

    KIND: ClassVar[int] = 1  # frame kind

    #: `schema_hash()` as computed by the worker's copy of the schema.
    schema_hash: str = ""
    #: The worker's process id.
    pid: int = 0
    model: ModelInfo = field(default_factory=ModelInfo)
    kv: KvCapacity = field(default_factory=KvCapacity)
    #: Most tokens a step with compressed-delta rows may have and still replay from one of
    #: the worker's CUDA graphs (its largest delta token bucket); a longer one runs eagerly,
    #: launching each kernel from Python. 0: the worker captures no such steps. The router
    #: keeps the prompt chunks of such steps within it.
    delta_graph_tokens: int = 0

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.schema_hash, self.pid, self.model.to_wire(), self.kv.to_wire(), self.delta_graph_tokens]

    @classmethod
    def from_wire(cls, a: list) -> Hello:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 5:
            return cls(a[0], a[1], ModelInfo.from_wire(a[2]), KvCapacity.from_wire(a[3]), a[4])
        m = cls()
        if n > 0:
            m.schema_hash = a[0]
        if n > 1:
            m.pid = a[1]
        if n > 2:
            m.model = ModelInfo.from_wire(a[2])
        if n > 3:
            m.kv = KvCapacity.from_wire(a[3])
        if n > 4:
            m.delta_graph_tokens = a[4]
        return m


@dataclass(slots=True)
class InspectVariant:
    """Asks the worker to validate a variant directory against its model and report its
    footprint. Changes no worker state; answered by an `VariantInfo` with the same id, in order
    with the step outputs.
    """

    KIND: ClassVar[int] = 6  # frame kind

    #: Router-chosen id, echoed in the answer.
    inspect_id: int = 0
    #: The PEFT directory (LoRA) or `deltaserve compress` output directory (delta).
    path: str = ""
    #: What the directory holds, as the router found it (its marker file): the worker
    #: inspects it as that kind.
    kind: VariantKind = VariantKind.LORA

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.inspect_id, self.path, self.kind]

    @classmethod
    def from_wire(cls, a: list) -> InspectVariant:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 3:
            return cls(a[0], a[1], VariantKind(a[2]))
        m = cls()
        if n > 0:
            m.inspect_id = a[0]
        if n > 1:
            m.path = a[1]
        if n > 2:
            m.kind = VariantKind(a[2])
        return m


@dataclass(slots=True)
class VariantInfo:
    """The worker's answer to `InspectVariant`."""

    KIND: ClassVar[int] = 7  # frame kind

    #: The `InspectVariant`'s id.
    inspect_id: int = 0
    #: Why the adapter cannot be served (names the file or field); `None` when it is valid.
    error: Optional[str] = None
    #: Pool pages the adapter's weights take on the GPU (`KvCapacity::bytes_per_block` each).
    num_blocks: int = 0
    #: Bytes of its host-memory copy.
    host_bytes: int = 0
    #: Largest rank over its adapted projections.
    max_rank: int = 0
    #: Adapted projections, e.g. `q_proj`, `v_proj`.
    target_modules: list[str] = field(default_factory=list)
    #: The kind inspected (`InspectVariant::kind`): a LoRA adapter takes `num_blocks` pool
    #: pages on the GPU, a delta one of the worker's delta slots (`num_blocks` 0).
    kind: VariantKind = VariantKind.LORA
    #: One line for people, e.g. `rank 8` or `4-bit 2:4, 2.6x smaller than fp16`.
    summary: str = ""

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.inspect_id, self.error, self.num_blocks, self.host_bytes, self.max_rank, self.target_modules, self.kind, self.summary]

    @classmethod
    def from_wire(cls, a: list) -> VariantInfo:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 8:
            return cls(a[0], a[1], a[2], a[3], a[4], a[5], VariantKind(a[6]), a[7])
        m = cls()
        if n > 0:
            m.inspect_id = a[0]
        if n > 1:
            m.error = a[1]
        if n > 2:
            m.num_blocks = a[2]
        if n > 3:
            m.host_bytes = a[3]
        if n > 4:
            m.max_rank = a[4]
        if n > 5:
            m.target_modules = a[5]
        if n > 6:
            m.kind = VariantKind(a[6])
        if n > 7:
            m.summary = a[7]
        return m


@dataclass(slots=True)
class WorkerConfig:
    """The worker's whole configuration: the router's first frame on a new link, written before
    the worker process starts (its argv names only the link's directory). The router's
    `ServerConfig` owns every default; the worker validates the values and answers with its
    `Hello` (or a fatal `WorkerError` naming the bad setting).
    """

    KIND: ClassVar[int] = 8  # frame kind

    #: The router's `schema_hash()`. First, so that a worker of another schema can still
    #: read it and answer with its own hash in a `Hello` the router then refuses.
    schema_hash: str = ""
    #: HF model directory (config.json, *.safetensors).
    model_dir: str = ""
    #: Torch device: `cpu` or `cuda:N`.
    device: str = ""
    #: `auto` (float32 on the CPU; the checkpoint's half type, else bfloat16, on CUDA),
    #: `float32`, `float16` or `bfloat16`.
    dtype: str = ""
    #: Tokens per KV page (the router's accounting unit).
    block_size: int = 0
    #: KV pool bytes; 0: 256 MiB on the CPU, on CUDA what `gpu_memory_utilization` leaves
    #: after the weights and a profiled activation reserve.
    kv_cache_bytes: int = 0
    #: Fraction of the GPU's memory the worker may use in total (CUDA only).
    gpu_memory_utilization: float = 0.0
    #: Most tokens one step computes (sizes the activation-reserve profiling run).
    max_num_batched_tokens: int = 0
    #: Cap on prompt + output tokens; `None`: the model's limit, bounded by the KV pool.
    max_model_len: Optional[int] = None
    #: Seed of the worker-global generator that unseeded requests sample from.
    seed: int = 0
    #: Kernel implementations.
    kernels: KernelBackend = KernelBackend.AUTO
    #: Largest decode batch replayed from a captured CUDA graph; 0: every step eager.
    cuda_graph_max_batch: int = 0
    #: Microseconds `recv` polls the ring before sleeping on the doorbell.
    recv_spin_us: int = 0
    #: CPU threads of torch's ops; 0: the CPUs the process may run on (CPU) or torch's
    #: default (CUDA).
    num_threads: int = 0
    #: Level of the `deltaserve.worker` logger: DEBUG, INFO, WARNING or ERROR.
    log_level: str = ""
    #: Largest LoRA rank served (sizes the per-step adapter tables); 0 turns LoRA off.
    max_lora_rank: int = 0
    #: Most distinct LoRA adapters one step may use (the router's max_num_seqs).
    max_loras_per_step: int = 0
    #: Host memory allocated (and pinned on CUDA) once for variant host copies; 0: none.
    host_arena_bytes: int = 0
    #: GPU slots for compressed deltas; 0 turns delta serving off.
    max_deltas: int = 0
    #: Whether the CUDA C++ ops of csrc/ are built and used where nvcc is found.
    cuda_ops: bool = False
    #: Where the CUDA C++ ops are built; `None`: ~/.cache/deltaserve.
    cache_dir: Optional[str] = None
    #: Run under cProfile, writing stats to `<profile_path>.<pid>`; `None`: no profiling.
    profile_path: Optional[str] = None
    #: Seconds between a profiled worker's stats files.
    profile_every_s: float = 0.0
    #: CPU LoRA helper processes, each pinned to one CPU: a cold adapter's prefill starts at
    #: once with its LoRA computed by them; 0 turns them off.
    cpu_lora_helpers: int = 0
    #: When the helpers take a cold prefill: `adaptive` (the profiled model predicts their
    #: compute ends before the load) or `always` (whenever one is free).
    cpu_lora_policy: str = ""

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.schema_hash, self.model_dir, self.device, self.dtype, self.block_size, self.kv_cache_bytes, float(self.gpu_memory_utilization), self.max_num_batched_tokens, self.max_model_len, self.seed, self.kernels, self.cuda_graph_max_batch, self.recv_spin_us, self.num_threads, self.log_level, self.max_lora_rank, self.max_loras_per_step, self.host_arena_bytes, self.max_deltas, self.cuda_ops, self.cache_dir, self.profile_path, float(self.profile_every_s), self.cpu_lora_helpers, self.cpu_lora_policy]

    @classmethod
    def from_wire(cls, a: list) -> WorkerConfig:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 25:
            return cls(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], KernelBackend(a[10]), a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24])
        m = cls()
        if n > 0:
            m.schema_hash = a[0]
        if n > 1:
            m.model_dir = a[1]
        if n > 2:
            m.device = a[2]
        if n > 3:
            m.dtype = a[3]
        if n > 4:
            m.block_size = a[4]
        if n > 5:
            m.kv_cache_bytes = a[5]
        if n > 6:
            m.gpu_memory_utilization = a[6]
        if n > 7:
            m.max_num_batched_tokens = a[7]
        if n > 8:
            m.max_model_len = a[8]
        if n > 9:
            m.seed = a[9]
        if n > 10:
            m.kernels = KernelBackend(a[10])
        if n > 11:
            m.cuda_graph_max_batch = a[11]
        if n > 12:
            m.recv_spin_us = a[12]
        if n > 13:
            m.num_threads = a[13]
        if n > 14:
            m.log_level = a[14]
        if n > 15:
            m.max_lora_rank = a[15]
        if n > 16:
            m.max_loras_per_step = a[16]
        if n > 17:
            m.host_arena_bytes = a[17]
        if n > 18:
            m.max_deltas = a[18]
        if n > 19:
            m.cuda_ops = a[19]
        if n > 20:
            m.cache_dir = a[20]
        if n > 21:
            m.profile_path = a[21]
        if n > 22:
            m.profile_every_s = a[22]
        if n > 23:
            m.cpu_lora_helpers = a[23]
        if n > 24:
            m.cpu_lora_policy = a[24]
        return m


@dataclass(slots=True)
class Shutdown:
    """Asks the worker to exit cleanly."""

    KIND: ClassVar[int] = 4  # frame kind

    reason: str = ""

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.reason]

    @classmethod
    def from_wire(cls, a: list) -> Shutdown:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 1:
            return cls(a[0])
        m = cls()
        if n > 0:
            m.reason = a[0]
        return m


@dataclass(slots=True)
class WorkerError:
    """A failure the worker reports instead of a `StepOutput`."""

    KIND: ClassVar[int] = 5  # frame kind

    #: The step that failed (0 when outside a step).
    step_id: int = 0
    message: str = ""
    #: Fatal: the worker exits after sending this and must be restarted. Recoverable: only
    #: the listed requests failed; the worker keeps serving.
    fatal: bool = False
    #: Requests that failed (all of the step's requests when the whole step failed).
    req_ids: list[int] = field(default_factory=list)

    def to_wire(self) -> list:
        """The positional array this struct is encoded as."""
        return [self.step_id, self.message, self.fatal, self.req_ids]

    @classmethod
    def from_wire(cls, a: list) -> WorkerError:
        """Builds the struct from its positional array; missing trailing fields take their defaults."""
        n = len(a)
        if n >= 4:
            return cls(a[0], a[1], a[2], a[3])
        m = cls()
        if n > 0:
            m.step_id = a[0]
        if n > 1:
            m.message = a[1]
        if n > 2:
            m.fatal = a[2]
        if n > 3:
            m.req_ids = a[3]
        return m


#: Every top-level message (the structs with a non-zero ``KIND``).
Message = Union[StepPlan, StepOutput, Hello, InspectVariant, VariantInfo, WorkerConfig, Shutdown, WorkerError]

_BY_KIND: dict[int, type[Message]] = {2: StepPlan, 3: StepOutput, 1: Hello, 6: InspectVariant, 7: VariantInfo, 8: WorkerConfig, 4: Shutdown, 5: WorkerError}
_KINDS = "StepPlan=2, StepOutput=3, Hello=1, InspectVariant=6, VariantInfo=7, WorkerConfig=8, Shutdown=4, WorkerError=5"
_packb = msgpack.packb
_unpackb = msgpack.unpackb


def encode(msg: Message) -> bytes:
    """One frame: ``msgpack([msg.KIND, msg.to_wire()])``, byte-identical to Rust's ``codec::encode``."""
    return _packb([msg.KIND, msg.to_wire()], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Decodes one frame into its message; raises ``ValueError`` saying what is wrong with a bad frame."""
    try:
        obj = _unpackb(frame, raw=False)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ValueError(f"bad frame: not one msgpack value ({e})") from e
    if type(obj) is not list or len(obj) != 2:
        raise ValueError(f"bad frame: expected a msgpack array [kind, body], got {type(obj).__name__}")
    kind, body = obj
    cls = _BY_KIND.get(kind) if type(kind) is int else None
    if cls is None:
        raise ValueError(f"unknown message kind {kind!r}: expected one of {_KINDS}")
    if type(body) is not list:
        raise ValueError(f"bad {cls.__name__} frame: body is {type(body).__name__}, expected an array")
    try:
        return cls.from_wire(body)
    except (TypeError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot decode {cls.__name__} body (kind {kind}): {e}") from e
