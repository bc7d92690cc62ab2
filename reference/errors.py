"""The one error family of dplab.

Catch ``DplabError`` to catch anything dplab raises on purpose::

    from dplab.reference.errors import ConfigError
    raise ConfigError("global_batch must be >= 1, got 0: pass a positive batch size")
"""

from __future__ import annotations

__all__ = ["DplabError", "ConfigError"]


class DplabError(Exception):
    """Base of every dplab error; messages say what to do."""


class ConfigError(DplabError, ValueError):
    """A configuration that cannot work; the message names the field and the fix."""
