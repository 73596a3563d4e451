"""Parses the Prometheus text format (``GET /metrics``) into ``{"name{labels}": value}``.

```text
 # HELP deltaserve_steps_total Engine steps run.          comments and HELP/TYPE lines: skipped
 deltaserve_steps_total 9                                → "deltaserve_steps_total": 9.0
 deltaserve_api_errors_total{type="not_found_error"} 1   → 'deltaserve_api_errors_total{type="not_found_error"}': 1.0
 x_bucket{le="+Inf",a="q\"b"} 3 1700000000000            → 'x_bucket{le="+Inf",a="q\"b"}': 3.0 (timestamp dropped)
```

Keys are re-rendered canonically (labels in the order written, ``name="value"`` joined by ``,``,
values escaped as Prometheus escapes them), so a key can be written by hand from what
``curl /metrics`` shows. Values are floats (``+Inf``, ``-Inf`` and ``NaN`` included).
"""

from __future__ import annotations

_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of ``text``, keyed ``name`` or ``name{label="value",...}``.

    Raises ``ValueError`` naming the line for a line that is not a sample.
    """
    out: dict[str, float] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key, value = _parse_sample(line)
        except (ValueError, IndexError) as e:
            raise ValueError(f"line {number} is not a Prometheus sample ({e}): {raw!r}") from None
        out[key] = value
    return out


def metric_key(name: str, labels: dict[str, str] | None = None) -> str:
    """The key ``parse_metrics`` uses for ``name`` with ``labels`` (in the server's order)."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _parse_sample(line: str) -> tuple[str, float]:
    end = 0
    while end < len(line) and line[end] not in "{ \t":
        end += 1
    name = line[:end]
    if not name:
        raise ValueError("no metric name")
    labels: dict[str, str] = {}
    if end < len(line) and line[end] == "{":
        end = _parse_labels(line, end + 1, labels)
    fields = line[end:].split()
    if len(fields) not in (1, 2):  # value, optional timestamp
        raise ValueError("expected a value and an optional timestamp")
    return metric_key(name, labels), float(fields[0])


def _parse_labels(line: str, i: int, labels: dict[str, str]) -> int:
    """Reads ``k="v",...}`` from ``line[i:]`` into ``labels``; returns the index after ``}``."""
    while True:
        while line[i] in " \t,":
            i += 1
        if line[i] == "}":
            return i + 1
        eq = line.index("=", i)
        key = line[i:eq].strip()
        i = eq + 1
        while line[i] in " \t":
            i += 1
        if line[i] != '"':
            raise ValueError(f"label {key} has no quoted value")
        i += 1
        value = []
        while line[i] != '"':
            if line[i] == "\\":
                i += 1
                value.append(_UNESCAPE.get(line[i], "\\" + line[i]))
            else:
                value.append(line[i])
            i += 1
        labels[key] = "".join(value)
        i += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
