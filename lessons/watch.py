"""``dplab lesson watch N DIR``: re-check a lesson's exercises every time a file in DIR is saved.

    watch(check=lambda: terminal.check(2, "work"), path="work")   # Ctrl-C stops it (exit 130)

As rustlings does: check once at the start, then poll the folder's files' modification times
(no file-watching dependency: a stat per file every ``poll_s``), and after a change wait until
nothing has changed for ``debounce_s`` (an editor's save is often several writes: a temporary
file, a rename, a second write), then check again. Caches and hidden files (``__pycache__``,
``.swp``) are not the learner's code and never trigger a check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["snapshot", "watch", "POLL_S", "DEBOUNCE_S"]

POLL_S = 0.5
DEBOUNCE_S = 0.3
_MAX_FILES = 10_000  # a watched folder is a handful of exercises, not a home directory


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path`` (not in hidden folders or ``__pycache__``):
    its (mtime_ns, size)."""
    seen: dict[str, tuple[int, int]] = {}
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        try:
            info = file.stat()
        except OSError:  # deleted between the listing and the stat: the next poll sees it gone
            continue
        if file.is_file():
            seen[str(rel)] = (info.st_mtime_ns, info.st_size)
        if len(seen) >= _MAX_FILES:
            break
    return seen


def watch(
    check: Callable[[], int],
    path: str | Path,
    poll_s: float = POLL_S,
    debounce_s: float = DEBOUNCE_S,
    on_wait: Callable[[], None] | None = None,
    max_checks: int | None = None,
) -> int:
    """Run ``check`` now and after every settled change under ``path``; returns the last check's
    result after ``max_checks`` checks (None: never, until Ctrl-C raises KeyboardInterrupt).
    ``on_wait`` is called after each check (the terminal says it is watching)."""
    folder = Path(path)
    checks, result = 0, 0
    last = snapshot(folder)
    while True:
        result, checks = check(), checks + 1
        if max_checks is not None and checks >= max_checks:
            return result
        if on_wait is not None:
            on_wait()
        last = _next_change(folder, last, poll_s, debounce_s)


def _next_change(folder: Path, last: dict[str, tuple[int, int]], poll_s: float,
                 debounce_s: float) -> dict[str, tuple[int, int]]:
    """Block until the folder differs from ``last`` and then stays the same for ``debounce_s``."""
    while True:
        time.sleep(poll_s)
        now = snapshot(folder)
        if now != last:
            break
    settled_at = time.monotonic()
    while time.monotonic() - settled_at < debounce_s:
        time.sleep(min(poll_s, debounce_s))
        again = snapshot(folder)
        if again != now:  # still being written: wait for quiet again
            now, settled_at = again, time.monotonic()
    return now
