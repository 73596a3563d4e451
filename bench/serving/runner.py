"""One experiment against one server, start to result file (:func:`run`)::

experiments.Experiment   one trace spec per point (n, rate, cv, popularity, ...)
  → variants.prepare_variants()
                         the files the server reads, under --work-dir (kept, reused by
                         later runs) or a temporary directory
  → servers.SERVERS[--server]
                         starts the server once for all points (deltaserve: the daemon with
                         --model and --lora-dir / --delta; peft, swap, merged: the baselines
                         of bench/baselines.py, SSE only), waits for /ready
  → replay.run_replay()  per point, in order; the server is idle between points; the result
                         file is rewritten after every point ("complete": false until the
                         last), so a killed run keeps what it measured. Interrupted during a
                         point (Ctrl-C / SIGINT, SIGTERM), the run also keeps that point: the
                         records of its requests sent so far (those still in flight with
                         error "interrupted"), summarized as any point (replay's docstring:
                         an interrupted point's makespan ends at the interruption), marked
                         "interrupted": true; the file is written, the server stopped
                         (further SIGINT / SIGTERM ignored meanwhile: `timeout` sends its
                         signal twice), and the interruption re-raised
  → probe_variants()     (deltazip) one fixed greedy prompt per probed variant: their outputs
                         differ when the variants' weights are really applied
  → write_result() + report.plot()
                         all points with their traces' parameters, summaries and per-request
                         rows, and the server's metrics (/metrics) or counters (/stats) over
                         each point; throughput vs n, SLO attainment vs rate, throughput and
                         mean latency vs rate, latency CDFs
"""

from __future__ import annotations

import contextlib
import gzip
import json
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import replay as rp
from bench import workload as wl
from bench.common import RESULTS, write_result
from bench.launch import Endpoint, ServerSpec
from bench.serving.experiments import WORKLOADS, Experiment, Point
from bench.serving.report import plot
from bench.serving.servers import SERVERS, merge_flags
from bench.serving.variants import DELTA_BITS, DELTA_GROUP, DELTA_SPARSE, FINETUNE_NOISE, prepare_variants

PROBE_TOKENS = 8
"""Greedy tokens generated per probed variant."""


def detect_devices() -> tuple[str, str]:
    """(``--devices`` value, device name for the result file): GPU 0 when CUDA is available."""
    try:
        import torch

        if torch.cuda.is_available():
            return "0", torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu", "cpu"


@contextlib.contextmanager
def work_directory(path: Path | None) -> Iterator[Path]:
    """``path`` (created, kept afterwards) or a temporary directory removed after the run."""
    if path is not None:
        path = Path(path).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="deltaserve-bench-") as tmp:
        yield Path(tmp)


def probe_variants(endpoint: Endpoint, names: list[str], vocab: tuple[int, int], timeout_s: float) -> dict[str, Any]:
    """One fixed prompt, ``PROBE_TOKENS`` greedy tokens (EOS ignored), for each of ``names`` in
    turn: per variant the output text, the chosen tokens' logprobs (the daemon reports them; the
    baselines do not), or the error; and how many of each differ. Variants whose weights differ
    give different logprobs even where a random model's greedy text coincides."""
    lo, hi = vocab
    prompt = [lo + (37 * i + 11) % (hi - lo) for i in range(8)]
    outputs: dict[str, str] = {}
    logprobs: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    for name in names:
        body = {"model": endpoint.model or name, "prompt": prompt, "max_tokens": PROBE_TOKENS, "ignore_eos": True,
                "temperature": 0.0, "stream": False, "logprobs": 1}  # fmt: skip
        req = urllib.request.Request(f"{endpoint.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                choice = json.loads(r.read())["choices"][0]
            outputs[name] = choice["text"]
            if (choice.get("logprobs") or {}).get("token_logprobs") is not None:
                logprobs[name] = choice["logprobs"]["token_logprobs"]
        except urllib.error.HTTPError as e:
            errors[name] = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return {"prompt": prompt, "max_tokens": PROBE_TOKENS, "outputs": outputs, "token_logprobs": logprobs,
            "errors": errors, "distinct_outputs": len(set(outputs.values())),
            "distinct_logprobs": len({tuple(v) for v in logprobs.values()})}  # fmt: skip


def run(exp: Experiment, *, server: str = "deltaserve", out_dir: Path | None = None, devices: str | None = None,
        daemon: Path | None = None, server_flags: list[str] | None = None, distinct_weights: int | None = None,
        distinct_checkpoints: int | None = None, plots: bool = True, suffix: str = "",
        work_dir: Path | None = None, record: bool = False) -> Path:  # fmt: skip
    """Runs every point of ``exp`` against ``server``; returns the result file (plots beside it).
    The model and variant files go to ``work_dir`` (kept and reused; default: a temporary
    directory); the result file is rewritten after every point, and once more with the partial
    point (``"interrupted": true``) when KeyboardInterrupt or SystemExit stops a point's replay,
    which is then re-raised (the file keeps ``"complete": false``). ``record`` (deltaserve only):
    the worker records every step (``deltaserve.sim.record``) to ``<name>-steps.jsonl.gz`` beside
    the result, whose ``step_breakdown`` says where the worker's time went (bench/step_breakdown.py)."""
    if server not in SERVERS:
        raise SystemExit(f"--server {server!r}: want one of {', '.join(sorted(SERVERS))}")
    auto_devices, device = detect_devices()
    devices = devices or auto_devices
    if devices == "cpu":
        device = "cpu"
    traces = [WORKLOADS[p.workload](**p.trace) for p in exp.points]
    all_variants = {v.name: v for t in traces for v in t.variants}
    full = all(v.kind == "full" for v in all_variants.values())
    name = exp.name + suffix
    log = (out_dir or RESULTS) / f"{name}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if record and server != "deltaserve":
        raise SystemExit(f"--record: only deltaserve's worker records its steps, not {server}'s")
    steps_file = (out_dir or RESULTS) / f"{name}-steps.jsonl"
    with work_directory(work_dir) as work:
        t0 = time.perf_counter()
        files = prepare_variants(exp, server, list(all_variants.values()), work, devices, distinct_weights,
                                 distinct_checkpoints)  # fmt: skip
        prepare_s = time.perf_counter() - t0
        spec = ServerSpec(model_dir=files.model_dir, lora_dir=files.lora_dir, devices=devices, deltas=files.deltas, env=files.env,
                          flags=merge_flags(exp.server_flags.get(server, ()), server_flags or []), daemon=daemon,
                          log=log)  # fmt: skip
        if record:
            from deltaserve.sim.record import recording_python

            steps_file.unlink(missing_ok=True)
            spec.python = str(recording_python(work / "recording-python", steps_file))
        payload: dict[str, Any] = {
            "device": device,
            "server": server,
            "server_flags": spec.flags,
            "model": exp.shape,
            "slo_tpot_s": exp.slo_tpot,
            "timeout_s": exp.timeout_s,
            "distinct_weight_files_per_rank": None if full else (distinct_weights or exp.distinct_weights),
            "adapters": len(all_variants),
            "adapter_generation_s": prepare_s,
            "client_event_loop": rp.event_loop_policy(),
            "complete": False,
            "points": [],
        }
        if full:
            payload["full_finetunes"] = {
                "delta_format": {"bits": DELTA_BITS, "sparsity": "2:4" if DELTA_SPARSE else "none",
                                 "group_size": DELTA_GROUP, "values": "random codes (common.write_random_delta_dir)"},
                "distinct_delta_payloads": distinct_weights or exp.distinct_weights,
                "distinct_checkpoints": distinct_checkpoints or exp.distinct_checkpoints,
                "finetune_noise": FINETUNE_NOISE,
            }  # fmt: skip
        t0 = time.perf_counter()
        # `stopping` exits after the server's context: what an interruption enters there lasts
        # until the server is stopped.
        with contextlib.ExitStack() as stopping, SERVERS[server](spec) as endpoint:
            payload["server_ready_s"] = time.perf_counter() - t0
            for p, trace in zip(exp.points, traces):
                print(f"[{name}] {p.label}: {len(trace.requests)} requests over {trace.duration:.1f} s",
                      flush=True)  # fmt: skip
                model_for = (lambda v, m=endpoint.model: m) if endpoint.model else None
                records: list[rp.Record] = []  # filled as requests are sent: kept when interrupted
                metrics_before = server_metrics(endpoint)
                try:
                    rp.run_replay(trace, endpoint.url, protocol=p.protocol, ws_url=endpoint.ws_url, model_for=model_for,
                                  timeout_s=exp.timeout_s, records=records)  # fmt: skip
                except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: keep the point so far, then stop
                    stopping.enter_context(_repeated_signals_ignored())
                    _add_point(payload, p, trace, records, exp, interrupted=True)
                    path = write_result(name, payload, out_dir)
                    print(f"    interrupted: partial result in {path}", flush=True)
                    raise
                _add_point(payload, p, trace, records, exp, interrupted=False)
                m = payload["points"][-1]["server_metrics"] = metrics_delta(metrics_before, server_metrics(endpoint))
                efficiency = payload["points"][-1]["served_step_efficiency"] = served_step_efficiency(m)
                workers = 1 if devices == "cpu" else len(devices.split(","))
                busy = payload["points"][-1]["makespan_per_floor"] = makespan_per_floor(
                    payload["points"][-1]["summary"]["makespan_s"], m, workers)  # fmt: skip
                if m:
                    print("    server: " + ", ".join(f"{k.removeprefix('deltaserve_').removesuffix('_total')} {m[k]:g}"
                                                    for k in METRICS_SHOWN if k in m)
                          + (f", served-step efficiency {efficiency:.2f}x floor" if efficiency else "")
                          + (f" (makespan {busy:.2f}x floor)" if busy else ""), flush=True)  # fmt: skip
                stats = baseline_stats(endpoint)
                if stats is not None:
                    payload["points"][-1]["server_stats"] = stats
                    print(f"    server: {stats}", flush=True)
                write_result(name, payload, out_dir)
            if exp.probe_variants:
                names = [v.name for v in traces[0].variants][: exp.probe_variants]
                payload["probe"] = probe_variants(endpoint, names, tuple(traces[0].params["vocab"]), exp.timeout_s)
                pr = payload["probe"]
                print(f"    probe of {len(names)} variants: {pr['distinct_outputs']} distinct outputs, "
                      f"{pr['distinct_logprobs']} distinct logprob sequences"
                      f"{', errors: ' + str(pr['errors']) if pr['errors'] else ''}", flush=True)  # fmt: skip
    payload["complete"] = True
    if record:
        payload["step_breakdown"] = _finish_recording(steps_file)
    path = write_result(name, payload, out_dir)
    if plots:
        plot([path])
    return path


def _finish_recording(steps_file: Path) -> dict[str, Any]:
    """Compresses the worker's recording (``.jsonl`` -> ``.jsonl.gz``), prints and returns its
    breakdown by kind of step."""
    from bench.step_breakdown import breakdown, read_recording, report

    result = breakdown(read_recording(steps_file))
    packed = steps_file.with_name(steps_file.name + ".gz")
    with steps_file.open("rb") as src, gzip.open(packed, "wb") as dst:
        dst.writelines(src)
    steps_file.unlink()
    print(f"    worker recording: {packed}")
    report(result)
    return {"recording": packed.name, **result}


METRICS_SHOWN = (
    "deltaserve_steps_total",
    "deltaserve_preemptions_total",
    "deltaserve_adapter_host_loads_total",
    "deltaserve_adapter_gpu_loads_total",
    "deltaserve_adapter_gpu_evictions_total",
    "deltaserve_adapter_host_deferrals_total",
    "deltaserve_adapter_gpu_load_deferrals_total",
    "deltaserve_worker_step_us_total",
    "deltaserve_worker_forward_us_total",
    "deltaserve_worker_floor_us_total",
    "deltaserve_worker_busy_us_total",
    "deltaserve_step_gap_us_p50",
)
"""The metrics a point's summary line prints (all of them go to the result file)."""


def _server_get(endpoint: Endpoint, path: str) -> bytes | None:
    """The body of GET ``path`` on the server, or None when it has no such route or does not answer."""
    base = endpoint.url.split("/v1/")[0]
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=5) as r:
            return r.read()
    except (OSError, ValueError):
        return None


def baseline_stats(endpoint: Endpoint) -> dict[str, Any] | None:
    """A baseline's ``/stats`` counters (bench/baselines.py ``Engine.stats``: loads, batches, slots,
    resident variants), or None when the server has none (the daemon, the fake server)."""
    body = _server_get(endpoint, "/stats")
    try:
        return None if body is None else json.loads(body)
    except ValueError:
        return None


def server_metrics(endpoint: Endpoint) -> dict[str, float] | None:
    """The server's Prometheus ``/metrics`` as {name: value} (unlabelled samples only), or None
    when it has none (the baselines, the fake server) or does not answer."""
    body = _server_get(endpoint, "/metrics")
    if body is None:
        return None
    try:
        text = body.decode()
    except ValueError:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return out or None


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """What a point did to the server's metrics: counters (``*_total``) as the point's increase,
    gauges as read after the point. None without metrics."""
    if before is None or after is None:
        return None
    return {k: (v - before.get(k, 0.0) if k.endswith("_total") else v) for k, v in after.items()}


def served_step_efficiency(delta: dict[str, Any] | None) -> float | None:
    """Σ worker time on the steps ÷ Σ step floor over a point (``deltaserve_worker_busy_us_total`` ÷
    ``deltaserve_worker_floor_us_total``: each step's own time, an overlapped step's wait for the one
    before it not counted; the floors from ``deltaserve.worker.step_floor``; 1.0 is the bound), or
    None without metrics or steps."""
    if not delta or not delta.get("deltaserve_worker_floor_us_total"):
        return None
    return float(delta.get("deltaserve_worker_busy_us_total", 0.0)) / float(delta["deltaserve_worker_floor_us_total"])


def makespan_per_floor(makespan_s: float, delta: dict[str, Any] | None, workers: int) -> float | None:
    """The point's makespan on each of ``workers`` workers ÷ Σ step floor: a check on the served-step
    efficiency from the client's clock (idle seconds included, so on a saturated point it is close to
    Σ busy ÷ Σ floor), or None without metrics or steps."""
    if not delta or not delta.get("deltaserve_worker_floor_us_total") or makespan_s <= 0:
        return None
    return makespan_s * 1e6 * workers / float(delta["deltaserve_worker_floor_us_total"])


@contextlib.contextmanager
def _repeated_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM do nothing inside (their handlers restored after): a run that one of
    them interrupted writes its partial point and stops its server undisturbed. ``timeout -s
    INT`` signals the process and then its process group, so the process gets the signal twice,
    the second often while the result is being written; a second Ctrl-C changes nothing either
    (the server's stop is bounded: SIGTERM, SIGKILL after 60 s). Main thread only (elsewhere a
    no-op: signals are handled there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _add_point(payload: dict[str, Any], p: Point, trace: wl.Trace, records: list[rp.Record], exp: Experiment,
               interrupted: bool) -> None:  # fmt: skip
    """Appends point ``p``'s summary and per-request rows to ``payload`` and prints its line; an
    ``interrupted`` point has the records of the requests sent before the interruption (those in
    flight then: error ``replay.INTERRUPTED``)."""
    summary = rp.summarize(records, slo_tpot=exp.slo_tpot)
    head = (f"INTERRUPTED after {len(records)} of {len(trace.requests)} requests sent, "
            f"{summary['completed']} completed: " if interrupted else "")  # fmt: skip
    print(f"    {head}{summary['throughput_req_s']:.2f} req/s, {summary['throughput_out_tok_s']:.0f} tok/s, "
          f"ttft p50 {_fmt(summary['ttft_s']['p50'])} s, e2e mean {_fmt(summary['e2e_s']['mean'])} s, "
          f"failed {summary['failed']} ({summary['interrupted']} of them cut by the interruption), "
          f"SLO {_fmt(summary['slo']['attainment'])}", flush=True)  # fmt: skip
    payload["points"].append({"label": p.label, "protocol": p.protocol, "trace": trace.params,
                              "interrupted": interrupted, "summary": summary,
                              "requests": [r.row() for r in records]})  # fmt: skip


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
