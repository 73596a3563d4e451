"""Typed stub of ``deltaserve._native``, the private Rust extension (``router/crates/py``).

Conversion only: the ring, doorbells and schema live in the Rust ``ipc`` crate, the safetensors
reader in ``tensorfile``, the scheduler in ``sched``. Blocking calls
release the GIL and check for signals at least every 100 ms (Ctrl-C interrupts them).

Errors: problems with the link's files or shared state raise ``OSError`` (with ``errno`` where the
OS gave one, e.g. ``FileNotFoundError`` for a missing ring); bad arguments (a frame larger than
``max_frame_len``, an invalid capacity, a negative timeout) raise ``ValueError``; a bounded
``send`` whose ring stayed full raises ``TimeoutError``.
"""

import os
from collections.abc import Sequence
from typing import Any, Final, Literal, Self, final

__all__ = [
    "DEFAULT_CAPACITY",
    "EmbeddedServer",
    "RouterLink",
    "PLACEMENTS",
    "SIM_FEATURES",
    "SchedError",
    "Scheduler",
    "SchedulerConfig",
    "WorkerLink",
    "read_safetensors_header",
    "read_safetensors_into",
    "regex_match",
    "run_cli",
    "schema_hash",
    "schema_text",
    "simulate",
]

#: Ring capacity in bytes used when none is given (4 MiB; frames up to half of it).
DEFAULT_CAPACITY: Final[int]

def schema_hash() -> str:
    """The wire schema hash computed by Rust (16 lowercase hex digits); must equal ``wire.SCHEMA_HASH``."""

def schema_text() -> str:
    """The canonical schema text the hash is computed from; must equal ``wire.SCHEMA_TEXT``."""

@final
class WorkerLink:
    """The worker's half of a router<->worker link in ``ipc_dir`` (created by the router).

    Receives ``StepPlan``/``Shutdown`` frames, sends ``Hello``/``StepOutput``/``WorkerError``
    frames (encode/decode them with ``deltaserve.wire``).
    """

    def __new__(cls, ipc_dir: str, spin_us: int = 0) -> Self:
        """Opens ``to_worker.ring``/``.bell`` (incoming) and ``from_worker.ring``/``.bell`` (outgoing).

        ``recv`` polls the ring for ``spin_us`` microseconds before sleeping on the doorbell.
        """

    def send(self, data: bytes, timeout_s: float | None = None) -> None:
        """Sends one frame, waiting while the ring is full (``None``: as long as it takes).

        Raises ``ValueError`` if ``len(data) > max_frame_len`` (large bytes never travel on the
        ring) and ``TimeoutError`` if the ring stayed full for ``timeout_s`` seconds.
        """

    def recv(self, timeout_s: float | None = None) -> bytes | None:
        """The next frame, waiting at most ``timeout_s`` seconds (``None``: forever); ``None`` on timeout."""

    @property
    def ipc_dir(self) -> str:
        """The link directory this half was opened on."""

    @property
    def max_frame_len(self) -> int:
        """Largest frame ``send`` accepts: half the ring capacity minus the 4-byte length prefix."""

@final
class RouterLink:
    """The router's half of a link, so Python tests and tools can play the router."""

    def __new__(cls, ipc_dir: str, create: bool = True, capacity: int = 4194304) -> Self:
        """Opens the router's half; with ``create`` first creates ``ipc_dir`` and its four files.

        ``capacity`` (bytes, a power of two, default ``DEFAULT_CAPACITY``) sizes each ring when
        creating. Creating replaces stale files of an earlier link in the same directory.
        """

    def send(self, data: bytes, timeout_s: float | None = None) -> None:
        """Sends one frame to the worker; same contract as ``WorkerLink.send``."""

    def recv(self, timeout_s: float | None = None) -> bytes | None:
        """The next frame from the worker; same contract as ``WorkerLink.recv``."""

    @property
    def ipc_dir(self) -> str:
        """The link directory this half was opened on."""

    @property
    def max_frame_len(self) -> int:
        """Largest frame ``send`` accepts."""

def read_safetensors_into(
    path: str | os.PathLike[str],
    copies: Sequence[tuple[str, int, int, int, bool]],
    dst_dtype: str,
    dst_ptr: int = 0,
    dst_len: int = 0,
) -> None:
    """Copies 2-D tensors of a safetensors file into a host buffer, without the GIL.

    ``copies``: ``(name, rows, cols, dst_offset, transpose)``; each tensor must exist with shape
    ``[rows, cols]`` and dtype F16, BF16 or F32; it is written (converted to ``dst_dtype``, rounding
    to nearest even) at element ``dst_offset`` of the buffer, row-major or transposed. Values that
    are not finite, in the file or after the conversion, raise ``ValueError`` naming the tensor and
    the first bad element; so does a missing tensor, another shape or dtype, a malformed file or a
    copy outside the buffer (checked before anything is written). ``OSError`` when the file cannot
    be opened. ``dst_ptr``/``dst_len``: address and byte size of a contiguous CPU buffer the caller
    keeps alive and untouched during the call; ``dst_ptr`` 0 checks everything and writes nothing.
    """

def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of every tensor in a safetensors file (``__metadata__`` left out),
    reading only its header, without the GIL and without mapping the file. ``ValueError`` for a
    malformed header, ``OSError`` when the file cannot be read."""

def regex_match(pattern: str, texts: list[str], whole: bool = False) -> list[bool]:
    """For each text, whether ``pattern`` matches at its start (``whole``: the whole text), as
    ``re.match`` / ``re.fullmatch`` would, with a linear-time engine (Rust's ``regex``): no
    pattern can backtrack catastrophically. ``ValueError`` (never quoting the pattern) for a
    pattern over 4096 bytes, one too large once compiled, or one the engine does not accept
    (look-around, back-references, malformed)."""

class SchedError(ValueError):
    """The scheduler refused a config, a request or a variant; the message names it and the numbers."""

    error_type: str
    """Stable label of the refusal, as in the router's metrics and HTTP errors: ``invalid_config``,
    ``duplicate_id``, ``empty_prompt``, ``zero_max_tokens``, ``context_length_exceeded``,
    ``kv_pool_too_small``, ``unknown_adapter``, ``invalid_adapter``, ``duplicate_adapter``,
    ``adapter_too_big``, ``adapter_in_use`` or ``deltas_disabled``."""

@final
class Scheduler:
    """The router's scheduler (``router/crates/sched``): continuous batching over one paged pool that
    holds the KV cache and LoRA adapter pages, plus the variants' tiers (disk, host, GPU pages or
    delta slots). The plans it forms are the ones the router sends its worker.

    Pure and deterministic: no IO and no clock (arrival stamps are the caller's numbers), so the
    same calls give the same plans. Steps go out as encoded ``wire.StepPlan`` frames and worker
    answers come back as encoded ``wire.StepOutput`` frames (``deltaserve.wire.encode`` /
    ``decode``), translated as the router translates them. Drive it like the router's engine::

        frame = sched.schedule()              # None: nothing can run now
        out = executor.step(wire.decode(frame))
        sched.update(wire.encode(out))

    With one step outstanding, ``schedule_ahead`` forms the next one before the first's output
    (the worker feeds each request the token it sampled in the step before).
    """

    def __new__(
        cls,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        host_adapter_bytes: int = 4294967296,
        prefetch_window: int = 64,
        max_deltas: int = 3,
        host_copy_reports: bool = False,
        gpu_load_reports: bool = False,
        delta_graph_tokens: int = 0,
        enable_prefix_caching: bool = False,
    ) -> Self:
        """A scheduler over an empty queue and ``num_blocks`` free pages of ``block_size`` tokens.

        The router takes ``block_size``, ``num_blocks`` and ``max_model_len`` from the worker's
        ``Hello``. ``max_num_seqs``: most requests running at once; ``max_num_batched_tokens``: the
        token budget of a step (prefill chunks plus decode tokens); ``host_adapter_bytes``: the
        budget of variant host copies (4 GiB); ``prefetch_window``: waiting requests whose variants are read
        into host memory ahead (0: off); ``max_deltas``: the worker's delta slots (0: deltas off);
        ``host_copy_reports``: the worker reports finished host reads (``StepOutput.host_ready``)
        and requests whose variant is still being read wait (the router turns it on; off, a host
        copy counts as ready once its ``to_host`` is sent); ``gpu_load_reports``: the worker copies a
        delta's ``to_gpu`` beside the steps and reports finished copies (``StepOutput.gpu_ready``), and
        while others run a delta is loaded ahead and its requests wait for the report (the router
        turns it on; off, a delta's ``to_gpu`` goes out with its request's admission and that step
        waits for the copy); ``delta_graph_tokens``: the most tokens of a step with delta rows the
        worker replays from a CUDA graph (its ``Hello``'s), within which such a step takes prompt
        chunks (0: no limit); ``enable_prefix_caching``: reuse the KV
        pages of prompt prefixes per variant registration (the router's ``--enable-prefix-caching``;
        a new request's ``num_computed_tokens`` is then its hit, whole pages shared with other
        requests). ``SchedError`` for a value out of range.
        """

    def register_adapter(
        self, adapter_id: int, kind: Literal["lora", "delta"], num_blocks: int, host_bytes: int, path: str
    ) -> None:
        """Registers a variant in the disk tier, with its footprint from the worker's ``VariantInfo``:
        ``num_blocks`` pool pages on the GPU (at least 1 for LoRA, 0 for a delta), ``host_bytes`` of
        host copy, and the directory ``to_host`` sends. It moves up when a request needs it.
        ``SchedError`` for id 0, an id already registered, a footprint that cannot fit, a delta with
        ``max_deltas`` 0; ``ValueError`` for another ``kind``."""

    def unregister_adapter(self, adapter_id: int) -> None:
        """Forgets a variant no live request names: its pages are free at once, its ``drop_gpu`` /
        ``drop_host`` go out with the next step. ``SchedError`` for an unknown or used id."""

    def add_request(
        self,
        req_id: int,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        arrival: int = 0,
        adapter_id: int = 0,
        eos_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        sampling: bytes | None = None,
    ) -> None:
        """Queues a request for at most ``max_tokens`` output tokens (fewer when it samples one of
        ``eos_token_ids``, unless ``ignore_eos``), with variant ``adapter_id`` (0: the base model).
        ``arrival`` orders admission and preemption (ties: the order of calls). ``sampling`` is the
        msgpack body of a ``wire.SamplingParams`` (``msgpack.packb(params.to_wire())``), sent with
        the request whenever it goes to the worker in full; ``None`` sends the wire defaults
        (greedy). ``SchedError`` for a live id, an empty prompt, ``max_tokens`` 0, a request longer
        than ``max_model_len`` or larger than the pool, an unregistered variant."""

    def schedule(self) -> bytes | None:
        """The next step as an encoded ``wire.StepPlan`` frame, or ``None`` when nothing can run (its
        releases and adapter ops then wait for the next step). Calling it with a step outstanding
        abandons that step: its requests are scheduled again from their last update. Raises
        ``ValueError`` (nothing changed) while a step formed by ``schedule_ahead`` is outstanding."""

    def schedule_ahead(self) -> bytes | None:
        """With exactly one step outstanding, the step after it as an encoded ``wire.StepPlan``,
        formed before that step's output: a request it samples for is scheduled for that token.
        ``None`` (nothing changed) when it would have to preempt or nothing can run: wait for the
        output, ``update``, then ``schedule``."""

    def update(self, output: bytes) -> list[tuple[int, int, Literal["length", "eos"] | None]]:
        """Applies an encoded ``wire.StepOutput`` frame answering the oldest outstanding step: its
        ``host_ready`` and ``gpu_ready`` first, then its tokens. Returns the tokens appended, as ``(req_id, token,
        finish_reason)``; a request that finished is released in the next step. A request the step
        scheduled to sample but the output gives no token for is scheduled again, or, when a later
        outstanding step builds on that token, preempted (released, then sent again in full).
        ``ValueError`` for a frame that is not a ``StepOutput`` or answers another step."""

    def host_copies_ready(self, adapter_ids: Sequence[int]) -> int:
        """The worker finished reading these variants' host copies (``update`` applies
        ``StepOutput.host_ready`` itself); returns how many pending reads this settled."""

    def gpu_copies_ready(self, adapter_ids: Sequence[int]) -> int:
        """The worker finished copying these deltas onto the GPU (``update`` applies
        ``StepOutput.gpu_ready`` itself); returns how many loads ahead this settled (ids with none
        pending are ignored)."""

    def abort(self, req_id: int) -> bool:
        """Ends a request (its client went away); a running one is released in the next step.
        Returns whether it was live."""

    def finish(self, req_id: int) -> bool:
        """Ends a request for a reason the caller decided (a stop string), counted as finished.
        Returns whether it was live."""

    def reset_worker(self) -> list[int]:
        """The worker lost its state (restarted): forgets outstanding steps, pending releases and
        every variant's residency, and requeues every running request to be sent in full. Returns
        the requeued ids, oldest first."""

    def contains(self, req_id: int) -> bool:
        """Whether the request is waiting or running."""

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    def output_tokens(self, req_id: int) -> list[int] | None:
        """The output tokens of a live request so far; ``None`` for one that is not live."""

    def skip_parent(self, req_id: int) -> int | None:
        """The running request a delta request rides on after skipping the queue (DeltaZip's
        skip-the-line); ``None`` for any other request."""

    def adapter_users(self, adapter_id: int) -> int:
        """Live requests naming the variant; 0 for an unknown one."""

    def adapter_residency(self, adapter_id: int) -> tuple[bool, list[int] | None] | None:
        """``(on_host, gpu_blocks)`` of a registered variant: whether the worker holds a host copy,
        and its GPU pages (``None`` when off the GPU, empty for a delta in its slot); ``None`` for
        an unknown id."""

    def stats(self) -> dict[str, int]:
        """The scheduler's counters by name (``SchedStats``): ``waiting``, ``running``,
        ``free_blocks``, ``used_blocks``, ``total_blocks``, ``num_preemptions``, ``steps``,
        ``pending_released``, ``num_finished``, ``num_aborted``, the variants' tiers and loads
        (``adapters_registered``, ``adapters_on_gpu``, ``deltas_on_gpu``, ``adapters_on_host``,
        ``adapter_blocks``, ``host_adapter_bytes``, ``adapter_gpu_loads``, ``adapter_host_loads``,
        ``adapter_gpu_evictions``), ``delta_skips``, ``delta_skip_preemptions``,
        ``host_deferrals`` and ``gpu_load_deferrals``."""

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` naming the first broken internal invariant (for tests)."""

#: Feature names of the simulator's step-latency model, in coefficient order (``deltaserve.sim``).
SIM_FEATURES: Final[list[str]]

#: The daemon's ``--placement`` policies, the names ``simulate`` takes (``caraserve`` first).
PLACEMENTS: Final[list[str]]

@final
class SchedulerConfig:
    """The scheduler's limits (``deltaserve_sched::SchedulerConfig``): constructed with the pool
    geometry and context limit, every other field at the scheduler's default; all fields are
    readable and writable."""

    block_size: int
    """Tokens per KV page."""
    num_blocks: int
    """Pages in the worker's KV pool."""
    max_num_seqs: int
    """Most requests running at once (default 256)."""
    max_num_batched_tokens: int
    """Token budget of one step (default 2048)."""
    max_model_len: int
    """Longest prompt + output."""
    host_adapter_bytes: int
    """Host-tier budget for variant copies, bytes (default 4 GiB)."""
    prefetch_window: int
    """Waiting requests whose variants are prefetched into host memory (default 64; 0: off)."""
    max_deltas: int
    """GPU delta slots (default 3; 0: deltas off)."""
    host_copy_reports: bool
    """Whether the worker reports finished host reads (default False; the daemon sets True)."""
    gpu_load_reports: bool
    """Whether the worker copies a delta's ``to_gpu`` beside the steps and reports finished copies, its
    requests admitted after the report while others run (default False; the daemon sets True). The
    simulator then times those copies on the worker's load stream, outside the steps."""
    delta_graph_tokens: int
    """Most tokens of a step with delta rows the worker replays from a CUDA graph; prompt chunks of
    such steps keep within it (default 0: no limit; the daemon takes the worker's ``Hello``'s)."""

    def __new__(cls, block_size: int, num_blocks: int, max_model_len: int) -> Self:
        """The scheduler's defaults around the pool geometry and context limit given."""

    def validate(self) -> None:
        """Raises ``SchedError`` naming the first unusable field."""

    def as_dict(self) -> dict[str, int | bool]:
        """Every field by name."""

    def __eq__(self, value: object, /) -> bool:
        """Equal when every field is."""

def simulate(
    config: SchedulerConfig,
    requests: Sequence[tuple[float, int, int, int]],
    variants: Sequence[tuple[str, int, int, int]],
    latency: tuple[Sequence[float], Sequence[float], tuple[float, float], tuple[float, float]],
    *,
    workers: int = 1,
    overlap_steps: bool = True,
    router_gap_s: float = 0.0,
    noise: float = 0.0,
    seed: int = 0,
    max_queued_per_worker: int | None = None,
    step_times: Sequence[float] | None = None,
    record_steps: bool = False,
    placement: str = "least-loaded",
    latency_profile: str | None = None,
    tpot_slo_s: float | None = None,
    host: tuple[Sequence[float], Sequence[float]] | None = None,
    graphs: tuple[int, int, int] | None = None,
    ingress_s: float = 0.0,
    deliver_s: float = 0.0,
    prompt_keys: Sequence[int] | None = None,
    dense_min_m: int | None = None,
    dense_lane: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Replays ``requests`` (``(arrival_s, prompt_len, output_len, variant)``, variant 0 = the
    base model, ``i`` = ``variants[i - 1]``) through ``workers`` copies of the real scheduler on a
    virtual clock, driven as the daemon's engine actor drives it. ``variants`` are ``(kind,
    num_blocks, host_bytes, rank)`` with kind ``"lora"`` or ``"delta"``; ``latency`` is
    ``(decode coefficients, prefill coefficients, disk_to_host_bps, host_to_gpu_bps)``, the
    coefficients in ``SIM_FEATURES`` order, the bandwidths ``(lora, delta)`` pairs in bytes/s.
    Each arrival goes where the router's ``placement`` policy (``PLACEMENTS``, the daemon's
    ``--placement``) puts it, priced with ``latency_profile`` (the JSON text ``--latency-profile``
    reads; None: the daemon's default) and ``tpot_slo_s`` (``--tpot-slo-ms``). ``host`` (decode,
    prefill coefficients) prices the worker's launch of each step, ``graphs`` (``graph_max_batch``,
    ``graph_max_tokens``, ``graph_max_delta_tokens``; None: no graphs) decides which steps run eagerly
    (feature ``eager``),
    ``dense_min_m`` (at least 2; None: no dense path) is the fewest tokens of a delta's prefill
    chunk the worker runs dense (feature ``dense_delta_segments`` of an eager step), ``dense_lane``
    the delta token buckets of the worker's mixed graphs, strictly ascending, each ``(tokens,
    lane_min_tokens)``: the fewest tokens of one delta in a step of that bucket that run in its dense
    lane (``deltaserve.sim.latency.dense_lane_buckets``; None: no lane; feature
    ``dense_delta_segments`` of a replayed step), ``ingress_s`` delays each
    arrival and ``deliver_s`` each token reaching its client; all off by default. ``prompt_keys``
    (one per request, 0 <= key < 2**64: equal keys, equal prompts) turns the scheduler's prefix
    caching on, as the daemon's default; None: off, every prompt all zeros.

    Returns ``first_token_s``, ``finish_s`` (NaN where never), ``scheduled_s`` (when each request
    was first sent to a worker), ``output_tokens``, ``worker_of``
    (-1: refused by ``max_queued_per_worker``), ``busy_s`` per worker, ``counters`` (scheduler
    counters summed over workers, ``prefix_hit_tokens`` included), ``peaks`` (largest on one worker) and ``steps`` (with
    ``record_steps``: ``(worker, step_id, ahead, start_s, end_s, [(request, tokens)],
    prefill_tokens, features)``, ``features`` a dict of the step's ``SIM_FEATURES``). Bad input raises ``ValueError`` naming it. Use ``deltaserve.sim.replay``.
    """

def run_cli(argv: list[str], python: str | os.PathLike[str] | None = None) -> int:
    """Runs the ``deltaserve`` command line (``argv[0]`` is the program name) as the daemon
    binary does and returns its exit code (0 after a clean shutdown or ``--help``, 2 for bad
    flags, 1 for other errors). ``python`` (``sys.executable``) runs the workers and tools unless
    ``--python`` names another. Holds no GIL while it runs; leave SIGINT and SIGTERM at their
    defaults so they shut the server down as in the binary. Use ``deltaserve.cli.main``."""

@final
class EmbeddedServer:
    """The router in this process: its async runtime on Rust threads, the workers as child
    processes, the HTTP API too with ``http``. ``flags`` are the daemon's flags
    (``deltaserve --help``) without the program name; ``python`` runs the workers unless
    ``--python`` is given. Bad input (flags, a request that fails validation, a variant refused
    at registration or deletion) raises ``ValueError`` and changes nothing; a failed start or
    request, or any call after ``stop()``, raises ``RuntimeError``. Waits can be interrupted
    with Ctrl-C (``KeyboardInterrupt``), which drops what was in flight. Use
    ``deltaserve.Server`` / ``deltaserve.LLM``."""

    def __new__(cls, flags: list[str], python: str | os.PathLike[str] | None = None, http: bool = True) -> Self: ...
    @property
    def url(self) -> str | None:
        """``http://host:port`` of the API (the bound port), or ``None`` without ``http``."""
    @property
    def running(self) -> bool:
        """Whether the server runs (not yet stopped)."""
    def register(self, name: str, path: str | os.PathLike[str], kind: str | None = None) -> str:
        """Registers the variant in ``path`` as ``name`` (``kind``: ``"lora"``, ``"delta"`` or
        ``None``: told from the directory); returns its registry entry as JSON."""
    def unregister(self, name: str) -> str:
        """Deletes the variant ``name``; returns its last registry entry as JSON."""
    def metrics_text(self) -> str:
        """The engine's metrics in the Prometheus text format."""
    def generate(self, bodies: list[str], chat: bool = False) -> list[dict[str, Any]]:
        """Runs the requests ``bodies`` (JSON texts of ``/v1/completions`` bodies, or
        ``/v1/chat/completions`` bodies with ``chat``) together; one dict per request, in order:
        ``prompt_token_ids``, ``token_ids``, ``text``, ``logprobs``, ``top_logprobs`` (lists of
        ``(token_id, logprob)``), ``finish_reason``. A bad body raises ``ValueError`` naming its
        index, before any request runs."""
    def stop(self) -> None:
        """Stops the API, then the workers, waiting until they exited; idempotent."""
