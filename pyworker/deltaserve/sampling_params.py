"""``SamplingParams``: how ``deltaserve.LLM`` samples, field for field the server's sampling fields
(``/v1/completions``: ``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``, ``stop``,
``logprobs``, ``ignore_eos``). They are checked by the server's own validation when a request is
made, so the limits (and their error messages) are the API's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    """Sampling settings of one ``LLM.generate`` / ``LLM.chat`` call.

    Attributes:
        temperature: softmax temperature in [0, 2]; 0 is greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; -1 or 0 keeps all.
        seed: seed for reproducible sampling (``None``: unseeded).
        max_tokens: most tokens to generate (``None``: the API's default, the rest of the context
            for chat).
        stop: a stop string or up to 4; the output ends before the first one and never contains
            it.
        logprobs: return each token's logprob and this many top alternatives (0..5; 0..20 for
            chat); ``None`` returns none.
        ignore_eos: keep generating past EOS tokens (to force output lengths).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False

    def request_fields(self, chat: bool) -> dict[str, Any]:
        """These settings as the fields of an API request body (``chat``: the chat endpoint's
        spelling of ``logprobs``)."""
        body: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.stop:
            body["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logprobs is not None:
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = self.logprobs
            else:
                body["logprobs"] = self.logprobs
        return body
