"""Numbers as people read them: what ``fill`` writes for a fact in a lesson's text.

    >>> from dplab.lessons.plain import num, times, size, count
    >>> num(3.0769230769230766), times(4 / 1.3), size(1_572_864), count(1_572_864)
    ('3.08', '3.08x', '1.5 MiB', '1,572,864')

In a template, a float with no format spec is ``num`` (3 significant digits); the specs ``size``,
``times``, ``count`` and ``num`` name these helpers (``"{sent:size}"`` -> ``1.5 MiB``); any other
spec is Python's own (``"{loss:.6f}"``). Integers are left as they are (``{n:,}`` adds commas).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

__all__ = ["num", "times", "size", "count", "readable", "answer", "SPECS"]

_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def num(x: float, digits: int = 3, commas: bool = True) -> str:
    """``x`` to ``digits`` significant digits, with commas past 999 (unless ``commas`` is False) and
    no exponent between 1e-4 and 1e15: 3.08, 0.0123, 2,080, 1.57e-05. An integral value drops its
    ``.0``."""
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if 1e-4 <= abs(x) < 1e3:
        return f"{x:.{digits}g}"
    if 1e3 <= abs(x) < 1e15:
        magnitude = math.floor(math.log10(abs(x)))
        decimals = max(digits - 1 - magnitude, 0)  # more digits than the integer part: decimals
        return f"{round(x, digits - 1 - magnitude):{',' if commas else ''}.{decimals}f}"
    return f"{x:.{digits}g}"


def times(x: float) -> str:
    """A ratio: ``3.08x``."""
    return f"{num(x)}x"


def size(n: float) -> str:
    """Bytes in binary units to 3 significant digits: ``512 bytes``, ``1.5 MiB``, ``64 KiB``."""
    n = float(n)
    unit = 0
    while abs(n) >= 1024 and unit < len(_UNITS) - 1:
        n, unit = n / 1024, unit + 1
    return f"{num(n)} {_UNITS[unit]}" if unit else f"{num(n)} bytes"


def count(n: float) -> str:
    """A whole number with commas: ``1,572,864``."""
    return f"{round(float(n)):,}"


def answer(x: Any, rel_tol: float = 0.0) -> str:
    """A question's answer exactly as it is judged: an integer in full with commas (65,504); a
    float with every digit of its integer part and as many decimals as it takes to sit within a
    tenth of the tolerance it is judged to (``rel_tol`` 0: the judge's own 1e-12), so the number
    printed is the number a right reply must match: 96,695 not 96,700, 0.337 not 0.34."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return str(x)
    if isinstance(x, numbers.Integral):
        return f"{int(x):,}"
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    if x == float(round(x)) and abs(x) < 1e15:
        return f"{round(x):,}"
    allowed = max(abs(x) * rel_tol / 10, 1e-12)
    # the integer part is never rounded
    whole = math.floor(math.log10(abs(x))) + 1 if abs(x) >= 1 else 1
    for digits in range(max(3, whole), 18):
        shown = num(x, digits)
        if abs(float(shown.replace(",", "")) - x) <= allowed:
            return shown
    return repr(x)


SPECS: dict[str, Callable[[Any], str]] = {"num": num, "times": times, "size": size, "count": count}


def readable(value: Any) -> str:
    """What a fact reads as with no format spec: floats through ``num`` (lists and tuples of them
    element by element); everything else as ``str`` (integers, strings, booleans untouched)."""
    if isinstance(value, bool) or isinstance(value, numbers.Integral):
        return str(value)
    if isinstance(value, numbers.Real):
        return num(value)
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
        # no thousands commas inside a list: "[0.25, 2080]" must not read as four numbers
        inner = ", ".join(
            str(v) if isinstance(v, numbers.Integral) else num(v, commas=False) for v in value
        )
        return (
            f"[{inner}]"
            if isinstance(value, list)
            else f"({inner}{',' if len(value) == 1 else ''})"
        )
    return str(value)
