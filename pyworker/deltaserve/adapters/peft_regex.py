"""PEFT's regex-valued ``adapter_config.json`` fields, matched with a linear-time engine.

``target_modules`` (a string), ``exclude_modules`` (a string), ``layers_pattern`` and the keys of
``rank_pattern`` / ``alpha_pattern`` are regexes PEFT runs with Python's ``re``: a backtracking
engine, on which a pattern such as ``(a+)+$`` can take forever. The worker runs them through
``deltaserve._native.regex_match`` (Rust's ``regex``, the engine and limits the router checked them
with before registering), so no adapter config can freeze or crash the worker; a pattern that
engine refuses (look-around, back-references, malformed, too large) is a ``LoraAdapterError``
naming the field, never quoting the pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._native import regex_match

Fail = Callable[[str], Exception]


def fullmatches(pattern: Any, names: Sequence[str], what: str, fail: Fail) -> list[bool]:
    """``re.fullmatch(pattern, name)`` for each name."""
    return _run(pattern, pattern, names, True, what, fail)


def layer_pattern_matches(pattern: Any, names: Sequence[str], what: str, fail: Fail) -> list[bool]:
    """PEFT's ``layers_pattern`` test: ``re.match(rf"(?:^|.*?\\.){pattern}\\.(?P<idx>\\d+)\\.", name)``."""
    return _run(pattern, rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", names, False, what, fail)


def pattern_keys(pattern: dict[str, Any], modules: Sequence[str], what: str, fail: Fail) -> dict[str, str | None]:
    """PEFT's ``get_pattern_key`` for every module: the first key ``k`` of ``pattern`` with
    ``re.match(rf"(.*\\.)?({k})$", module)``, or None."""
    found: dict[str, str | None] = dict.fromkeys(modules)
    for i, key in enumerate(pattern):
        hits = _run(key, rf"(.*\.)?({key})$", modules, False, f"{what} key #{i}", fail)
        for module, hit in zip(modules, hits, strict=True):
            if hit and found[module] is None:
                found[module] = key
    return found


def _run(raw: Any, pattern: str, names: Sequence[str], whole: bool, what: str, fail: Fail) -> list[bool]:
    if not isinstance(raw, str):
        raise fail(f"{what} must be a string")
    try:
        return regex_match(pattern, list(names), whole)
    except ValueError as e:
        raise fail(f"{what} is refused: {e}") from None
