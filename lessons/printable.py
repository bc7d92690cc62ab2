"""Text that code we did not write printed or raised, made safe to show in a terminal or a page.

    >>> printable("\\x1b[31mred\\x1b[0m, then a bell\\x07")
    'red, then a bell\\\\x07'

A learner's ``print`` of colours, a clear-screen or a carriage return, quoted raw, would act on the
terminal that shows ``dplab lesson check`` (recolour it, wipe the report, overwrite a line) and
litter the app's page. Escape sequences are dropped, every other control character is written
out, and newlines and tabs stay.
"""

from __future__ import annotations

import re

__all__ = ["printable"]

# a terminal's escape sequences: CSI (colours, clearing the screen, moving the cursor), OSC (the
# window's title, links), and the two-character ones
_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])")
# what may still act on a terminal or reorder the text: control characters but newline and tab,
# and Unicode's bidirectional overrides
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe to show in a terminal or a page: escape sequences removed (a learner's colours
    and cursor moves), every other control character written out as ``\\xNN`` (a carriage
    return, a bell), newlines and tabs kept."""
    text = _ANSI.sub("", text)
    return _CONTROL.sub(_written_out, text)


def _written_out(m: re.Match) -> str:
    code = ord(m[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
