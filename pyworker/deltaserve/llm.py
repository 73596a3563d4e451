"""``deltaserve.LLM``: offline generation in the style of ``vllm.LLM``, straight into the engine.

.. code-block:: python

    llm = deltaserve.LLM("path/to/model", loras={"sql": "path/to/adapter"}, deltas={"ft": "path/to/delta"})
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=32), variant=[None, "sql", "ft"])
    outs[1].outputs[0].text, outs[1].outputs[0].token_ids, outs[1].outputs[0].finish_reason
    llm.chat([{"role": "user", "content": "hi"}], variant="sql")[0].outputs[0].text

Requests go to the engine of a router in this process (``_native.EmbeddedServer`` without HTTP),
validated by the API's own checks; all prompts of one call, whatever their variants, are queued
together and so batched together. Calls block without holding the GIL and without touching
asyncio, so they work inside a running event loop (Jupyter); Ctrl-C cancels the call's requests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from deltaserve.embedded import flags_from, start
from deltaserve.sampling_params import SamplingParams
from deltaserve.server import parse_prometheus

Prompt = str | list[int]
"""A prompt: text (tokenized with the model's tokenizer, BOS added as the API does) or token ids."""
Message = dict[str, Any]
"""A chat message as the API takes it: ``{"role": ..., "content": ...}``."""


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: its index among the request's outputs (always 0: one output per request).
        text: the generated text, without the stop string that ended it.
        token_ids: the generated tokens.
        logprobs: each token's logprob, when ``SamplingParams.logprobs`` asked for them.
        top_logprobs: each token's top alternatives ``{token_id: logprob}``, when asked.
        finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_tokens``) or
            ``"abort"``.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the tokens' logprobs, when they were asked for."""
        return None if self.logprobs is None else sum(self.logprobs)


@dataclass
class RequestOutput:
    """What one prompt produced.

    Attributes:
        prompt: the prompt text (``None`` when given as token ids or chat messages).
        prompt_token_ids: the prompt as the model saw it (after the chat template).
        variant: the variant it ran with (``None``: the base model).
        outputs: its generated sequences (one).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    variant: str | None
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        """Always true: ``generate`` returns finished requests."""
        return True


class LLM:
    """A base model and its variants for offline generation:
    ``LLM(model, loras=..., deltas=..., devices=..., **flags)``.

    Args:
        model: HF model directory (``None``: the bundled demo model and its demo adapters).
        loras: LoRA adapters, ``{name: PEFT directory}``.
        deltas: compressed deltas, ``{name: directory written by deltaserve compress}``.
        devices: ``"cpu"`` or CUDA device ids (``"0"``, ``"0,1"``): one worker each.
        **flags: any other flag of ``deltaserve --help`` in Python spelling (``max_num_seqs=8``).

    Raises ``ValueError`` for a flag the daemon does not take, ``RuntimeError`` when the engine
    cannot start. ``close()`` (or leaving a ``with`` block, or interpreter exit) stops the workers.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        loras: dict[str, str | os.PathLike[str]] | None = None,
        deltas: dict[str, str | os.PathLike[str]] | None = None,
        devices: str | int | list[int] | list[str] = "cpu",
        **flags: Any,
    ) -> None:
        args = flags_from(model=model, loras=loras, deltas=deltas, devices=devices, **flags)
        self._engine = start(args, http=False, owner=self)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        variant: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Completes every prompt, all in one batch, and returns one ``RequestOutput`` each, in
        order. ``sampling_params`` and ``variant`` (a variant's name, ``None`` for the base) are
        one for all prompts or one per prompt. Raises ``ValueError`` for a bad request (named by
        its index; nothing runs then) and ``RuntimeError`` when the engine fails one."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            batch: list[Prompt] = [prompts]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        bodies = [{"prompt": p} for p in batch]
        texts = [p if isinstance(p, str) else None for p in batch]
        return self._run(bodies, texts, sampling_params, variant, chat=False)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        variant: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Answers one conversation (a list of messages) or several (a list of such lists),
        rendered with the model's chat template, all in one batch; otherwise as ``generate``."""
        if messages and isinstance(messages[0], dict):
            conversations = [list(messages)]
        else:
            conversations = [list(c) for c in messages]
        bodies: list[dict[str, Any]] = [{"messages": c} for c in conversations]
        return self._run(bodies, [None] * len(bodies), sampling_params, variant, chat=True)

    def register(self, name: str, path: str | os.PathLike[str], kind: str | None = None) -> dict[str, Any]:
        """Adds the variant in ``path`` as ``name`` (``kind``: ``"lora"``, ``"delta"`` or ``None``
        to tell from the directory); returns its registry entry."""
        return json.loads(self._engine.register(name, os.fspath(path), kind))

    def unregister(self, name: str) -> dict[str, Any]:
        """Removes the variant ``name``; returns its last registry entry."""
        return json.loads(self._engine.unregister(name))

    def metrics(self) -> dict[str, float]:
        """The engine's metrics as ``{sample name with labels: value}`` (``Server.metrics``)."""
        return parse_prometheus(self._engine.metrics_text())

    def close(self) -> None:
        """Stops the engine and its workers, waiting until they exited; idempotent."""
        self._engine.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(
        self,
        bodies: list[dict[str, Any]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        variant: str | None | Sequence[str | None],
        chat: bool,
    ) -> list[RequestOutput]:
        n = len(bodies)
        params = per_request(sampling_params if sampling_params is not None else SamplingParams(), n, "sampling_params")
        variants = per_request(variant, n, "variant")
        for body, sp, v in zip(bodies, params, variants):
            body.update(sp.request_fields(chat))
            if v is not None:
                body["model"] = v
        done = self._engine.generate([json.dumps(b) for b in bodies], chat)
        out = []
        for text, v, sp, d in zip(texts, variants, params, done):
            asked = sp.logprobs is not None
            completion = CompletionOutput(
                index=0,
                text=d["text"],
                token_ids=d["token_ids"],
                logprobs=d["logprobs"] if asked else None,
                top_logprobs=[dict(alts) for alts in d["top_logprobs"]] if asked else None,
                finish_reason=d["finish_reason"],
            )
            out.append(RequestOutput(text, d["prompt_token_ids"], v, [completion]))
        return out


def per_request(value: Any, n: int, what: str) -> list[Any]:
    """``value`` for each of ``n`` requests: a list or tuple must have ``n`` entries; anything
    else (one value, a string) is repeated."""
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{what}: {len(value)} given for {n} requests")
        return list(value)
    return [value] * n
