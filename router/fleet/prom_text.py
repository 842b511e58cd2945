"""A small, fast reader of the Prometheus text exposition format (version 0.0.4).

It extracts only the samples the caller names. A worker's /metrics page is tens of KB and is
read every scrape interval per worker, while the router needs a handful of series from it, so
instead of tokenising every line we let `str.find` (C speed) jump straight to lines that start
with a wanted name; every other line, comments included, is never looked at in Python.

Supported: comments and blank lines (skipped), labels with the escapes \\\\, \\" and \\n,
an optional timestamp after the value, and the values NaN, +Inf and -Inf. Sample lines are
expected to start at the beginning of a line, as every Prometheus client library writes them.
"""

from __future__ import annotations

Labels = dict[str, str]
Sample = tuple[Labels, float]

_NAME_END = frozenset("{ \t")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


def parse_samples(text: str, wanted: frozenset[str]) -> dict[str, list[Sample]]:
    """The samples of every wanted metric name, in page order, keyed by name.

    Names are exact sample names (`x_total`, `x_bucket`, `x_sum`), not family names. A wanted
    name that does not occur is absent from the result. Raises ValueError on a malformed line
    of a wanted metric; malformed lines of other metrics are not examined.
    """
    found: dict[str, list[Sample]] = {}
    for name in wanted:
        samples = _samples_of(text, name)
        if samples:
            found[name] = samples
    return found


def _samples_of(text: str, name: str) -> list[Sample]:
    samples: list[Sample] = []
    size = len(text)
    needle = "\n" + name
    # The first line has no newline before it; every other match is one past the newline.
    start = 0 if text.startswith(name) else _line_after(text.find(needle))
    while start >= 0:
        after = start + len(name)
        # A longer name sharing the prefix (`x_total` vs `x_total_created`) is another metric.
        if after < size and text[after] in _NAME_END:
            end = text.find("\n", after)
            if end < 0:
                end = size
            samples.append(_parse_rest(text, after, end, name))
        start = _line_after(text.find(needle, after))
    return samples


def _line_after(newline: int) -> int:
    return newline + 1 if newline >= 0 else -1


def _parse_rest(text: str, pos: int, end: int, name: str) -> Sample:
    """Parse `{labels} value [timestamp]` of one sample line, `pos` just after the name."""
    labels: Labels = {}
    if text[pos] == "{":
        pos = _parse_labels(text, pos + 1, end, labels, name)
    fields = text[pos:end].split()
    if not fields or len(fields) > 2:
        raise ValueError(f"malformed sample of {name!r}: {text[pos:end]!r}")
    try:
        value = float(fields[0])
    except ValueError:
        raise ValueError(f"malformed value of {name!r}: {fields[0]!r}") from None
    return labels, value


def _parse_labels(text: str, pos: int, end: int, labels: Labels, name: str) -> int:
    """Fill `labels` from `a="x",b="y"}` starting at `pos`; return the index after `}`."""
    while True:
        while pos < end and text[pos] in " \t":
            pos += 1
        if pos >= end:
            raise ValueError(f"unterminated labels of {name!r}")
        if text[pos] == "}":
            return pos + 1
        eq = text.find("=", pos, end)
        if eq < 0 or eq + 1 >= end or text[eq + 1] != '"':
            raise ValueError(f"malformed label of {name!r}: {text[pos:end]!r}")
        key = text[pos:eq].strip()
        pos = eq + 2
        close = text.find('"', pos, end)
        if close < 0:
            raise ValueError(f"unterminated label value of {name!r}")
        raw = text[pos:close]
        if "\\" in raw:
            value, pos = _unescape(text, pos, end, name)
        else:
            value, pos = raw, close + 1
        labels[key] = value
        while pos < end and text[pos] in " \t":
            pos += 1
        if pos < end and text[pos] == ",":
            pos += 1


def _unescape(text: str, pos: int, end: int, name: str) -> tuple[str, int]:
    """The slow path for a label value containing backslashes; returns (value, index after)."""
    out: list[str] = []
    while pos < end:
        char = text[pos]
        if char == '"':
            return "".join(out), pos + 1
        if char == "\\" and pos + 1 < end:
            pos += 1
            escaped = text[pos]
            # Unknown escapes are kept verbatim, as prometheus_client's own parser does.
            out.append(_UNESCAPE.get(escaped, "\\" + escaped))
        else:
            out.append(char)
        pos += 1
    raise ValueError(f"unterminated label value of {name!r}")
