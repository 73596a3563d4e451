"""The profile's measurements: random adapters, the grid of steps, their features, the fit.

Grid (every point timed ``reps`` times after one warm-up step; the median counts)::

    decode   batch b in --batches, with k adapters of rank r (request i uses adapter i mod k),
             k in {0 (base), 1, min(b, 16)} and r in --ranks: Σ rank over distinct adapters = k·r
             varies apart from the token count b
    prefill  one prompt of P tokens in --prompts, base or one adapter of each rank in --ranks

Each step is one ``Executor.step`` on plans the profile forms itself (as ``bench/decode_step.py``
does: cached tokens are not computed, their KV pages are whatever the pool holds), so a sample is
the worker's time on that step as the daemon runs it, without the router. Features follow
``deltaserve.sim.latency`` (the simulator's definitions, owned by ``router/crates/py``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltaserve import wire
from deltaserve.adapters.lora import hf_module_name, projection_features
from deltaserve.model.arch import ModelConfig
from deltaserve.sim.latency import LatencyModel

GREEDY = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=None)
DISTINCT_PER_RANK = 16
"""Adapter ids per rank (one directory each, read once per id): the most distinct adapters a
decode batch gets, so host and pool memory stay bounded (16 rank-64 q/k/v 7B adapters: 1.6 GB)."""


def random_lora_dir(out: Path, cfg: ModelConfig, rank: int, targets: Sequence[str], seed: int = 0) -> Path:
    """A PEFT adapter directory with random weights of ``rank`` on ``targets`` (alpha = rank;
    small B so outputs stay finite): profiling data, never a reference."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none", "use_rslora": False,
              "base_model_name_or_path": "random", "inference_mode": True}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    shapes = projection_features(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.{hf_module_name(layer, proj)}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(np.float16)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.01).astype(np.float16)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


class _Steps:
    """Plans for an executor: request ids, step ids and KV pages handed out in order."""

    def __init__(self, ex: Any, first_page: int) -> None:
        self.ex = ex
        self.page = first_page
        self.req = 1
        self.step_id = 1

    def _sync(self) -> None:
        if self.ex.device.type == "cuda":
            torch.cuda.synchronize(self.ex.device)

    def run(self, plan: wire.StepPlan) -> float:
        """Seconds of one step (the step is complete when ``step`` returns its tokens)."""
        self._sync()
        t0 = time.perf_counter()
        self.ex.step(plan)
        return time.perf_counter() - t0

    def plan(self, **kw: Any) -> wire.StepPlan:
        self.step_id += 1
        return wire.StepPlan(step_id=self.step_id, **kw)

    def new(self, tokens: int, computed: int, adapter: int, pages: int) -> wire.NewRequest:
        ids = torch.randint(3, self.ex.config.vocab_size, (tokens,)).tolist()
        blocks = list(range(self.page, self.page + pages))
        self.req += 1
        return wire.NewRequest(
            req_id=self.req, token_ids=ids, num_prompt_tokens=tokens, num_computed_tokens=computed,
            num_scheduled_tokens=tokens - computed, block_ids=blocks, sampling=GREEDY, adapter_id=adapter,
        )  # fmt: skip


def _features(chunks: Sequence[tuple[int, int]], adapters: Sequence[int], ranks: dict[int, int]) -> dict[str, float]:
    """The simulator's features of a step: ``chunks`` (start, length) per request, its adapter ids."""
    distinct = {a for a in adapters if a}
    return {
        "tokens": sum(n for _, n in chunks),
        "seqs": len(chunks),
        "prefill_tokens": sum(n for _, n in chunks if n > 1),
        "context_tokens": sum(s + n for s, n in chunks),
        "prefill_attention": sum(n * (s + n) for s, n in chunks if n > 1),
        "lora_rank_sum": sum(ranks[a] for a in distinct),
        "lora_segments": len(distinct),
        "lora_tokens": sum(n for (_, n), a in zip(chunks, adapters) if a),
    }


def measure(
    ex: Any, dirs: dict[int, Path], ranks: dict[int, int], *, batches: Sequence[int], prompts: Sequence[int],
    ctx: int, reps: int,
) -> list[dict[str, float]]:  # fmt: skip
    """The samples (features + ``step_s``) of the grid (module docstring) on executor ``ex``, whose
    adapters ``dirs`` (id -> directory, rank ``ranks[id]``) it places first."""
    steps = _Steps(ex, 0)
    ops = []
    for aid, d in dirs.items():
        info = ex.inspect_variant(str(d))
        if info.error is not None:
            raise ValueError(f"adapter {d}: {info.error}")
        ops.append(wire.VariantOp(aid, wire.TierOp.TO_HOST, str(d), []))
        ops.append(wire.VariantOp(aid, wire.TierOp.TO_GPU, "", list(range(steps.page, steps.page + info.num_blocks))))
        steps.page += info.num_blocks
    ex.step(steps.plan(adapter_ops=ops))
    bs = ex.block_size
    by_rank: dict[int, list[int]] = {}
    for aid, r in ranks.items():
        by_rank.setdefault(r, []).append(aid)
    samples: list[dict[str, float]] = []
    first_page = steps.page
    for b in batches:
        for r in sorted(by_rank):
            pool = by_rank[r]
            for k in sorted({0, 1, min(b, len(pool))}):
                if r != min(by_rank) and k == 0:
                    continue  # the base batch once per size
                adapters = [pool[i % k] if k else 0 for i in range(b)]
                pages = -(-(ctx + reps + 2) // bs)
                steps.page = first_page
                if first_page + b * pages > ex.num_blocks:
                    raise ValueError(f"the KV pool ({ex.num_blocks} pages) is too small for batch {b} at --ctx {ctx}")
                new = []
                for a in adapters:
                    new.append(steps.new(ctx + 1, ctx, a, pages))
                    steps.page += pages
                ids = [n.req_id for n in new]
                ex.step(steps.plan(new_requests=new))  # the warm-up step
                times = []
                for _ in range(reps):
                    running = [wire.RunningRequest(req_id=i, num_scheduled_tokens=1, new_block_ids=[]) for i in ids]
                    times.append(steps.run(steps.plan(running=running)))
                ex.step(steps.plan(released=ids))
                chunks = [(ctx + 1 + reps // 2, 1)] * b
                samples.append({**_features(chunks, adapters, ranks), "step_s": statistics.median(times)})
    for n in prompts:
        pages = -(-(n + 1) // bs)
        if first_page + pages > ex.num_blocks:
            raise ValueError(f"the KV pool ({ex.num_blocks} pages) is too small for a {n}-token prompt")
        for a in [0] + [aids[0] for _, aids in sorted(by_rank.items())]:
            times = []
            for _ in range(reps + 1):
                steps.page = first_page
                req = steps.new(n, 0, a, pages)
                times.append(steps.run(steps.plan(new_requests=[req])))
                ex.step(steps.plan(released=[req.req_id]))
            samples.append({**_features([(0, n)], [a], ranks), "step_s": statistics.median(times[1:])})
    return samples


def profile(
    model_dir: Path, *, device: str = "cpu", dtype: str = "auto", batches: Sequence[int] = (1, 8, 32, 64),
    ranks: Sequence[int] = (8, 16, 32, 64), prompts: Sequence[int] = (128, 512, 1024),
    targets: Sequence[str] = ("q_proj", "k_proj", "v_proj"), ctx: int = 256, reps: int = 5, kv_cache_bytes: int = 0,
) -> LatencyModel:  # fmt: skip
    """Measures the grid on ``model_dir`` and fits the simulator's latency model (module docstring)."""
    from deltaserve.worker.executor import Executor

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"--model {model_dir}: no config.json (an HF model directory is needed)")
    cfg = ModelConfig.from_model_dir(Path(model_dir))
    unknown = set(targets) - set(projection_features(cfg))
    if unknown:
        raise ValueError(f"--targets: {sorted(unknown)} are not projections of this model")
    ex = Executor(
        model_dir, device=device, dtype=dtype, kv_cache_bytes=kv_cache_bytes, max_lora_rank=max(ranks),
        max_num_batched_tokens=max(max(prompts), max(batches)), max_deltas=0,
    )  # fmt: skip
    per_rank = min(max(batches), DISTINCT_PER_RANK)
    with tempfile.TemporaryDirectory(prefix="deltaserve-profile-") as tmp:
        dirs: dict[int, Path] = {}
        rank_of: dict[int, int] = {}
        aid = 0
        for r in ranks:
            d = random_lora_dir(Path(tmp) / f"r{r}", cfg, r, targets, seed=r)
            for _ in range(per_rank):  # distinct ids on one directory: a batch of distinct adapters
                aid += 1
                dirs[aid], rank_of[aid] = d, r
        samples = measure(ex, dirs, rank_of, batches=batches, prompts=prompts, ctx=ctx, reps=reps)
    name = torch.cuda.get_device_name(ex.device) if ex.device.type == "cuda" else "cpu"
    ex.close()
    return LatencyModel.fit(samples, device=name, source=f"deltaserve profile --model {model_dir}")


__all__ = ["measure", "profile", "random_lora_dir"]
