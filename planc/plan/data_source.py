"""How a plan keeps its ``train { data }``: "synthetic", a token file's resolved path, or a
weighted mixture's sources as the text of a JSON list of ``[weight, path]`` pairs (no
stored path starts with ``[``: every one is absolute). How a mixture is sampled is
planc.data.blend's."""

from __future__ import annotations

import json
import math


def blend_of(data: str) -> tuple[tuple[float, str], ...] | None:
    """The (weight, path) pairs of a mixture's text, or None for one source."""
    if not data.startswith("["):
        return None
    pairs = json.loads(data)
    if not isinstance(pairs, list) or len(pairs) < 2 or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], (int, float))
            and not isinstance(p[0], bool) and math.isfinite(p[0]) and p[0] > 0
            and isinstance(p[1], str) and p[1] for p in pairs):
        raise ValueError("a mixture is a list of at least two [weight, path] pairs with "
                         "positive weights")
    return tuple((float(w), p) for w, p in pairs)


def blend_text(pairs) -> str:
    return json.dumps([[weight, path] for weight, path in pairs])


def paths_of(data: str) -> tuple[str, ...]:
    """The files ``data`` reads: a mixture's sources, or the one path."""
    pairs = blend_of(data)
    return (data,) if pairs is None else tuple(path for _, path in pairs)


def checked(text: str, what: str) -> str:
    """``text`` as a plan.json or model table holds a data source: "synthetic", a path or a
    mixture's text; ValueError, naming ``what``, for a mixture's text that is not one."""
    try:
        blend_of(text)
    except ValueError:
        raise ValueError(f"{what} is {text[:60]!r}, neither a path nor a mixture of "
                         f"[weight, path] pairs") from None
    return text

