"""BlockLLM's application mix (issue 23): 20 variants of one base served three ways, Poisson arrivals
with uniform and skewed popularity; parameter memory, throughput, p50 / p95 latency per way.

    python -m bench.zoo_mix [--work-dir DIR] [--rate 1] [--duration 30] [--ways per-model,delta,zoo]
    python -m bench.zoo_mix --smoke          # the tiny smoke shape (8 layers) on the CPU: a check

The mix on a base of L layers (random weights, Llama-2-7B shape by default)::

    partial fine-tunes (8)  four families k: a parent ``pf<k>`` that froze the first f_k of the
                            layers (f = 50, 62.5, 75, 90 %) and owns the rest, and a child
                            ``pf<k>c`` made from it: the same blocks but its last 3 layers
    full fine-tunes (6)     ``ft<i>``: every layer changed
    LoRAs (6)               ``lora<i>``: rank 16 on q, k, v, o

The ways (one server start each, every point replayed against it)::

    per-model   per-model provisioning: the swap baseline (bench/baselines.py, DeltaZip's whole-model
                swapping) holding every variant as a whole fp16 model (LoRAs merged), --resident auto
    delta       the daemon: every partial and full fine-tune as a ΔCompress delta of every layer
                (random 4-bit 2:4 payloads, ``common.write_random_delta_dir``), LoRAs as LoRA
    zoo         the daemon with ``--zoo``: the partial fine-tunes as a block zoo (own blocks only, a
                family's shared blocks stored once and, when both are resident, held once on the GPU
                and batched per block), full fine-tunes as deltas, LoRAs as LoRA

Parameter memory is the bytes of variant weights each way stores (whole models; delta payloads and
LoRA files; distinct zoo blocks, deltas and LoRA files), the base counted apart. Latency is each
request's end-to-end time; throughput is output tokens per second over the point's makespan
(``replay.summarize``). The weights are random: the delta payloads are random codes of the right
format and size, the zoo's blocks are layers cut from them (``write_zoo``), so the work done per
token is the real one, not the outputs.

Files go under ``--work-dir`` (default a temporary directory) per shape and are reused by later runs:
a first Llama-2-7B run writes the base and one fine-tuned checkpoint (2 x 13.5 GB, for per-model),
two delta payloads (2 x ~3.9 GB) and the zoo's blocks (~2.5 GB), which takes minutes; the timed part is sized for one 80 GB GPU and
about 6 minutes (3 ways x 2 popularities x 30 s, plus server starts and the swap baseline's drain).
Result: ``bench/results/zoo_mix-<device>-<date>.json`` (with the commit and the shapes; a run of some
ways only: ``zoo_mix-<ways>-<device>-<date>.json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from bench import replay as rp
from bench import workload as wl
from bench.common import SMOKE_SHAPE, shape_config, write_random_delta_dir, write_result
from bench.launch import ServerSpec, deltaserve_server
from bench.serving.runner import detect_devices
from bench.serving.servers import swap_server
from bench.serving.variants import checkpoint_bytes, write_adapters, write_base_checkpoint, write_full_variants

FREEZE = (0.5, 0.625, 0.75, 0.9)
"""Fractions of layers each partial fine-tune family froze (BlockLLM: 50-90 %)."""
CHILD_OWN_LAYERS = 3
"""A family's child changes this many more of the last layers (the issue's "all but their last three")."""
FULL, LORAS, LORA_RANK = 6, 6, 16
PAYLOADS = 2
"""Distinct random delta payloads the delta variants and the zoo's blocks are cut from."""
WAYS = ("per-model", "delta", "zoo")


def mix(num_layers: int) -> dict[str, dict[str, Any]]:
    """Variant name -> {"kind": partial | full | lora, "own": {layer: payload index} (partial)}."""
    out: dict[str, dict[str, Any]] = {}
    for k, f in enumerate(FREEZE):
        first = min(int(round(f * num_layers)), num_layers - 1)
        parent = {layer: k % PAYLOADS for layer in range(first, num_layers)}
        child = dict(parent)
        for layer in range(max(first, num_layers - CHILD_OWN_LAYERS), num_layers):
            child[layer] = (k + 1) % PAYLOADS  # other content: an own block of the child alone
        out[f"pf{k}"] = {"kind": "partial", "own": parent}
        out[f"pf{k}c"] = {"kind": "partial", "own": child}
    out.update({f"ft{i}": {"kind": "full"} for i in range(FULL)})
    out.update({f"lora{i}": {"kind": "lora"} for i in range(LORAS)})
    return out


def file_bytes(paths: list[Path]) -> int:
    """Bytes of the distinct files behind ``paths`` (links resolved, each inode once)."""
    seen, total = set(), 0
    for p in paths:
        st = os.stat(p)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def write_zoo(zoo: Path, base: Path, payloads: list[Path], variants: dict[str, dict[str, Any]]) -> Path:
    """A block zoo (``deltaserve.zoo``'s layout, ``read_manifest``-valid) of the partial fine-tunes:
    own block (layer i's attention or FFN, from payload j) = that layer's packed linears and norm
    deltas cut from payload j, one file per (component, payload) whichever variants use it; the
    served ``variants/<name>/`` directories are written by the zoo's own ``write_delta_dir``."""
    from deltaserve.compress.delta_dir import as_json, load_delta, model_signature, signature_hash
    from deltaserve.model.arch import ModelConfig
    from deltaserve.zoo.add import write_delta_dir
    from deltaserve.zoo.blocks import Checkpoint, component_of, components, tensor_names
    from deltaserve.zoo.manifest import BASE_BLOCK, empty_manifest, read_manifest, write_manifest

    if (zoo / "manifest.json").is_file():
        return zoo
    shutil.rmtree(zoo, ignore_errors=True)
    (zoo / "blocks").mkdir(parents=True)
    cfg = ModelConfig.from_model_dir(base)
    names, sig = tensor_names(cfg), as_json(model_signature(cfg))
    fake_hashes = {c: hashlib.sha256(f"base|{c}".encode()).hexdigest() for c in components(cfg.num_layers)}
    manifest = empty_manifest({"name": base.name, "config": sig, "config_sha256": signature_hash(sig),
                               "components": fake_hashes})  # fmt: skip
    loaded = [load_delta(p) for p in payloads]
    for name, v in variants.items():
        if v["kind"] != "partial":
            continue
        chain: list[dict[str, Any]] = []
        for c in components(cfg.num_layers):
            layer = int(c.split(".")[1]) if c.startswith("layers.") else -1
            src = v["own"].get(layer)
            if src is None:
                if chain and chain[-1]["block"] == BASE_BLOCK:
                    chain[-1]["components"][1] = c
                else:
                    chain.append({"components": [c, c], "block": BASE_BLOCK})
                continue
            bid = f"{c}.payload{src}.q4sg64"
            if bid not in manifest["blocks"]:
                dmanifest, packed, dense = loaded[src]
                tensors, entries = {}, {}
                for module, p in packed.items():
                    if component_of(f"{module}.weight") == c:
                        tensors.update({f"{module}.{s}": t.contiguous() for s, t in p.tensors().items()})
                        entries[module] = dmanifest["tensors"][module]
                for tname, t in dense.items():
                    if tname in names[c]:
                        tensors[tname], entries[tname] = t.contiguous(), dmanifest["tensors"][tname]
                rel = f"blocks/{bid}.safetensors"
                save_file(tensors, str(zoo / rel))
                manifest["blocks"][bid] = {
                    "component": c, "storage": "delta", "file": rel, "bytes": (zoo / rel).stat().st_size,
                    "content_sha256": hashlib.sha256(bid.encode()).hexdigest(), "tensors": entries,
                    "compression": {"bits": 4, "sparsity": "2:4", "group_size": 64},
                }  # fmt: skip
            chain.append({"component": c, "block": bid})
        entry = {"finetuned": {"name": name, "config_sha256": signature_hash(sig)}, "storage": "delta",
                 "options": {}, "chain": chain, "similarity": {}, "shared_equivalent": [],
                 "fp16_bytes": checkpoint_bytes(json.loads((base / "config.json").read_text()))[0],
                 "delta_dir": f"variants/{name}"}  # fmt: skip
        manifest["variants"][name] = entry
        own = [seg["block"] for seg in chain if seg["block"] != BASE_BLOCK]
        write_delta_dir(zoo, entry["delta_dir"], name, manifest, Checkpoint(base), names, sig, entry, own)
    write_manifest(zoo, manifest)
    read_manifest(zoo)  # the zoo's own validation
    return zoo


def prepare(work: Path, config: dict, variants: dict[str, dict[str, Any]], ways: list[str], devices: str):
    """The files of every way (reused when present): base, payloads, zoo, LoRAs, whole models."""
    gen = "cpu" if devices == "cpu" else "cuda"
    base = write_base_checkpoint(work, config, gen)
    payloads = []
    for k in range(PAYLOADS):
        d = work / "zoo-mix-payloads" / f"w{k}"
        if not (d / "manifest.json").is_file():
            shutil.rmtree(d, ignore_errors=True)
            write_random_delta_dir(base, d, 4, True, 64, seed=300 + k)
        payloads.append(d)
    loras = [wl.Variant(n, "lora", LORA_RANK) for n, v in variants.items() if v["kind"] == "lora"]
    lora_dir = write_adapters(work / "zoo-mix-loras", loras, config, distinct=2, weights=work / "zoo-mix-lora-weights")
    deltas: dict[str, Path] = {}
    root = work / "zoo-mix-deltas"
    shutil.rmtree(root, ignore_errors=True)
    for i, name in enumerate(n for n, v in variants.items() if v["kind"] != "lora"):
        src = payloads[i % PAYLOADS]
        d = root / name
        d.mkdir(parents=True)
        shutil.copyfile(src / "manifest.json", d / "manifest.json")
        for f in src.iterdir():
            if f.name != "manifest.json":
                (d / f.name).symlink_to(f)
        deltas[name] = d
    files: dict[str, Any] = {"base": base, "lora_dir": lora_dir, "deltas": deltas}
    if "zoo" in ways:
        files["zoo"] = write_zoo(work / "zoo-mix-zoo", base, payloads, variants)
    if "per-model" in ways:
        whole = [wl.Variant(n, "full") for n in variants]
        files["models"] = write_full_variants(work, work / "zoo-mix-models", "swap", whole, config, 1, 2, gen).lora_dir
    return files


def memory(way: str, files: dict[str, Any], variants: dict[str, dict[str, Any]], config: dict) -> dict[str, int]:
    """Bytes of variant weights each way stores (module docstring), and the base's."""
    full_fp16 = checkpoint_bytes(config)[0]
    lora_files = sorted(files["lora_dir"].glob("*/adapter_model.safetensors"))
    lora_bytes = sum(os.stat(p).st_size for p in lora_files)  # each adapter read on its own
    payload = {n: sum(os.stat(f).st_size for f in d.iterdir()) for n, d in files["deltas"].items()}
    if way == "per-model":
        variant_bytes = full_fp16 * len(variants)
    elif way == "delta":
        variant_bytes = sum(payload.values()) + lora_bytes
    else:
        zoo = files["zoo"]
        blocks = file_bytes(sorted((zoo / "blocks").iterdir()))
        variant_bytes = blocks + sum(b for n, b in payload.items() if variants[n]["kind"] == "full") + lora_bytes
    return {"variant_bytes": variant_bytes, "base_bytes": full_fp16}


def serve(way: str, files: dict[str, Any], variants: dict[str, dict[str, Any]], devices: str, smoke: bool, log: Path):
    """The server of ``way`` (a context manager yielding an ``Endpoint``)."""
    if way == "per-model":
        flags = ["--resident", "2" if smoke else "auto", "--max-batch", "32"]
        return swap_server(ServerSpec(files["base"], files["models"], devices, flags, log=log))
    slots = "4" if smoke else "6"
    flags = ["--max-deltas", slots, "--variant-host-bytes", str((1 << 30) if smoke else (32 << 30))]
    if way == "delta":
        deltas = {n: d for n, d in files["deltas"].items() if variants[n]["kind"] != "lora"}
    else:
        deltas = {n: d for n, d in files["deltas"].items() if variants[n]["kind"] == "full"}
        flags += ["--zoo", str(files["zoo"])]
    return deltaserve_server(ServerSpec(files["base"], files["lora_dir"], devices, flags, log=log, deltas=deltas))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_mix", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--smoke", action="store_true", help="the tiny smoke shape with 8 layers, on the CPU")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--popularity", default="uniform,zipf-1.5")
    ap.add_argument("--rate", type=float, default=None, help="requests per second (1; smoke 4)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per point (30; smoke 2)")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    ways = args.ways.split(",")
    for w in ways:
        if w not in WAYS:
            raise SystemExit(f"--ways {w!r}: want some of {', '.join(WAYS)}")
    devices, device = ("cpu", "cpu") if args.smoke else detect_devices()
    shape = SMOKE_SHAPE if args.smoke else args.shape
    config = shape_config(shape, 8 if args.smoke else None)
    rate = args.rate or (4.0 if args.smoke else 1.0)
    duration = args.duration or (2.0 if args.smoke else 30.0)
    lengths = ((4, 12), (2, 6)) if args.smoke else ((8, 256), (8, 64))
    vocab = (3, config["vocab_size"])
    variants = mix(config["num_hidden_layers"])
    names = list(variants)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="zoo-mix-"))
    work = work / f"{shape}-{config['num_hidden_layers']}l"
    t0 = time.perf_counter()
    files = prepare(work, config, variants, ways, devices)
    print(f"files ready in {time.perf_counter() - t0:.1f} s under {work}", flush=True)
    result: dict[str, Any] = {
        "device": device, "shape": shape, "config": config, "rate": rate, "duration": duration,
        "lengths": {"prompt": list(lengths[0]), "output": list(lengths[1])},
        "variants": {n: {**v, "own": sorted(v.get("own", {}))} for n, v in variants.items()}, "ways": {},
    }  # fmt: skip
    for way in ways:
        log = work / f"server-{way}.log"
        t_start = time.perf_counter()
        points = []
        with serve(way, files, variants, devices, args.smoke, log) as ep:
            started = time.perf_counter() - t_start
            for pop in args.popularity.split(","):
                trace = wl.deltazip(rate, duration, pop, len(names), lengths[0], lengths[1], vocab, seed=0)
                records = rp.run_replay(trace, ep.url, model_for=lambda v: names[int(v[2:])], timeout_s=900)
                s = rp.summarize(records)
                e2e = [r.e2e for r in records if r.error is None and r.e2e is not None]
                p50, p95 = np.percentile(e2e, [50, 95]).tolist() if e2e else (None, None)
                points.append({"popularity": pop, "summary": s, "e2e_p50_s": p50, "e2e_p95_s": p95})
                print(f"{way:9s} {pop:9s} {s['completed']}/{s['requests']} done, "
                      f"{s['throughput_out_tok_s']:.1f} tok/s, p50 {p50} s, p95 {p95} s", flush=True)  # fmt: skip
        result["ways"][way] = {"memory": memory(way, files, variants, config), "server_start_s": started,
                               "points": points}  # fmt: skip
    result["wall_s"] = time.perf_counter() - t0
    name = "zoo_mix" if set(ways) == set(WAYS) else "zoo_mix-" + "-".join(ways)  # runs of some ways apart
    path = write_result(name, result, args.out_dir)
    print(f"result: {path}")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
