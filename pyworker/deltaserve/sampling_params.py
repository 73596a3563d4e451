"""``SamplingParams``: how ``deltaserve.LLM`` samples, field for field the server's sampling fields
(``/v1/completions``: ``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``, ``stop``,
``logprobs``, ``ignore_eos``, ``logit_bias``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``). They are checked by the server's own validation when a request is
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
        logit_bias: token id -> bias in [-100, 100] added to its logit (at most 300 entries).
        presence_penalty: in [-2, 2]; subtracted from every token generated so far (OpenAI).
        frequency_penalty: in [-2, 2]; subtracted once per time a token was generated (OpenAI).
        repetition_penalty: > 0 (1 is off); divides the positive logits of the prompt's and the
            output's tokens and multiplies the others (vLLM, transformers).
        min_tokens: no EOS or ``stop_token_ids`` token (and no stop string) before this many
            output tokens (vLLM).
        stop_token_ids: token ids that end the output (finish reason ``stop``; their text is not
            in the output) (vLLM).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None

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
        if self.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in self.logit_bias.items()}
        if self.presence_penalty:
            body["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty:
            body["frequency_penalty"] = self.frequency_penalty
        if self.repetition_penalty != 1.0:
            body["repetition_penalty"] = self.repetition_penalty
        if self.min_tokens:
            body["min_tokens"] = self.min_tokens
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            body["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logprobs is not None:
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = self.logprobs
            else:
                body["logprobs"] = self.logprobs
        return body
