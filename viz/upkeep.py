"""The app server's upkeep: a session that has ended gives its memory back.

    start()        # in the server, once (``dplab app`` does): a thread that sweeps every EVERY_S
    sweep()        # one sweep now; returns how many ended sessions it shut down

Streamlit keeps a disconnected session for ``server.disconnectedSessionTTL`` (120 s) so that a
reload can resume it, and then forgets it without shutting it down (streamlit#12506): the files
its visitor uploaded stay in the upload manager and its session state stays in memory, for good.
Watched (``watch``), the storage queues every session it lets go of, and a sweep shuts them down
(which drops their files and state), collects, and asks the C allocator to give free memory back
to the system (``malloc_trim``): parsing a trace makes many small objects, and the freed heap
otherwise stays the process's.

This reaches into Streamlit's session manager (``_session_mgr._session_storage._cache``, a
TTLCache): where a version of Streamlit has no such thing, a sweep only collects and trims.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from typing import Any

__all__ = ["EVERY_S", "start", "sweep", "watch"]

EVERY_S = 10.0  # between sweeps: ended sessions wait their TTL anyway


_ended: list[Any] = []  # sessions Streamlit's storage let go of, to be shut down by a sweep
_lock = threading.Lock()


def watch(runtime: Any) -> bool:
    """Make Streamlit's session storage queue every session it lets go of (whenever its TTLCache
    expires entries: on a sweep, or on any later save or delete); False where it has no such
    storage. Once per runtime."""
    manager = getattr(runtime, "_session_mgr", None)
    cache = getattr(getattr(manager, "_session_storage", None), "_cache", None)
    expire = getattr(cache, "expire", None)
    if expire is None:
        return False
    if getattr(expire, "watched", False):
        return True

    def expiring(*args: Any, **kwargs: Any) -> Any:
        removed = expire(*args, **kwargs)
        with _lock:
            _ended.extend(info.session for _, info in removed if getattr(info, "session", None))
        return removed

    expiring.watched = True  # type: ignore[attr-defined]
    cache.expire = expiring  # the instance's: TTLCache's own methods call self.expire too
    return True


def _expire(runtime: Any) -> None:
    manager = runtime._session_mgr
    with getattr(manager, "_storage_lock", None) or threading.Lock():
        manager._session_storage._cache.expire()


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        pass


def sweep(runtime: Any = None) -> int:
    """Shut down every ended session, collect, give free memory back; the sessions shut down.
    ``runtime``: Streamlit's (None: the running one, if any)."""
    if runtime is None:
        from streamlit import runtime as streamlit_runtime

        runtime = streamlit_runtime.get_instance() if streamlit_runtime.exists() else None
    if runtime is not None and watch(runtime):
        _expire(runtime)
    with _lock:
        ended = _ended[:]
        del _ended[:]
    count = len(ended)
    while ended:
        ended.pop().shutdown()  # its uploaded files, session state and script thread go
    gc.collect()
    _trim()
    return count


def _sweeping(every_s: float) -> None:
    while True:
        time.sleep(every_s)
        try:
            sweep()
        except Exception:  # noqa: BLE001 - upkeep must never take the server down
            pass


def start(every_s: float = EVERY_S) -> threading.Thread:
    """Sweep every ``every_s`` seconds for the life of the process (a daemon thread)."""
    thread = threading.Thread(target=_sweeping, args=(every_s,), name="dplab-app-upkeep",
                              daemon=True)
    thread.start()
    return thread
