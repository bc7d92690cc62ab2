"""How long a world waits: the collective timeout and the start-up allowance, two separate knobs.

    DPLAB_TIMEOUT=120 dplab train ...          # each wait of a running world (default 60 s)
    DPLAB_START_TIMEOUT=300 dplab train ...    # ranks starting up: interpreters, imports, MPI_Init

They measure different things. A collective waits for a peer that is already running, so a short
timeout finds a hang fast (the tests use 1-2 s). Starting eight MPI interpreters on two cores takes
seconds of imports and MPI_Init before the first rank can answer, whatever the collectives need, so
start-up gets its own allowance instead of failing (and leaking MPICH's shared memory) under
``DPLAB_TIMEOUT=1``.

A value must be a finite number of seconds greater than zero: ``abc``, ``0``, ``-1``, ``inf`` and
``nan`` are refused with one line that says so, because ``inf`` would mean "hang for ever" and a
``nan`` deadline never arrives.
"""

from __future__ import annotations

import math
import os

from dplab.reference.errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_START_TIMEOUT_S", "seconds", "check_timeout",
           "default_timeout", "start_timeout"]

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_START_TIMEOUT_S = 60.0


def seconds(text: str, name: str) -> float:
    """``text`` as a number of seconds, or one ConfigError naming ``name`` and what it accepts."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a number of seconds > 0 (e.g. 60), got {text!r}")
    return value


def check_timeout(value: float, name: str = "timeout") -> float:
    """The ``timeout=`` argument: a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a number of seconds > 0 (e.g. 60.0), got {value!r}")
    return float(value)


def _env(name: str, default: float) -> float:
    text = os.environ.get(name)
    return default if text is None else seconds(text, name)


def default_timeout() -> float:
    """``DPLAB_TIMEOUT`` (default 60 s): how long any blocking wait of a running world may take.

    Returns:
        The timeout in seconds.

    Raises:
        ConfigError: ``DPLAB_TIMEOUT`` is set to something other than a number of seconds > 0.
    """
    return _env("DPLAB_TIMEOUT", DEFAULT_TIMEOUT_S)


def start_timeout() -> float:
    """``DPLAB_START_TIMEOUT`` (default 60 s): how long ranks may take to start and connect."""
    return _env("DPLAB_START_TIMEOUT", DEFAULT_START_TIMEOUT_S)
