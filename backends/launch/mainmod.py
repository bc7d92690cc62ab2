"""Functions of the user's script on ranks that are fresh interpreters (MPI), as multiprocessing's
spawn does.

    # demo.py, run as `python demo.py`
    def demo(comm): ...
    if __name__ == "__main__":
        launch(demo, 3, backend="mpi")     # works: the ranks load demo.py as __mp_main__

A pickled function is a name: ``demo`` in ``__main__`` is sent as ``__main__.demo``. In an MPI rank
``__main__`` is dplab's rank loop, so the name would not resolve. When it does not, the rank loads
the launcher's main script under the module name ``__mp_main__`` (so its ``if __name__ ==
"__main__":`` guard keeps it from launching again), aliases it as ``__main__`` and unpickles again.
That is multiprocessing's spawn, done lazily: a job that names nothing of ``__main__`` never pays
for loading the script.

Where there is no script to load (``python -c``, a REPL, a notebook), ``check_sendable`` refuses the
job in the launcher with one error that says what to do. A script without the guard would launch
again inside every rank; ``booting()`` lets ``World`` refuse that with the fix in the message.
"""

from __future__ import annotations

import os
import runpy
import sys
import types
from collections.abc import Callable
from typing import Any

from dplab.reference.errors import ConfigError

__all__ = ["ENV", "main_spec", "check_sendable", "load_main", "booting"]

ENV = "DPLAB_MAIN"  # "path:/abs/script.py" or "module:pkg.mod", set by the launcher for its ranks
_state = {"booting": False, "loaded": False}


def main_spec() -> str | None:
    """How a fresh interpreter can load this process's ``__main__``; None when it cannot."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:  # python -m pkg.mod
        return None if name == "__main__" or name.endswith(".__main__") else f"module:{name}"
    path = getattr(main, "__file__", None)
    if path and os.path.isfile(path):
        return f"path:{os.path.abspath(path)}"
    return None


def check_sendable(fn: Callable[..., Any]) -> None:
    """ConfigError if ``fn`` lives in a ``__main__`` that an MPI rank cannot load."""
    if getattr(fn, "__module__", None) == "__main__" and main_spec() is None:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"{name} is defined in __main__ of an interactive session (python -c, "
                          "a REPL, a notebook), which MPI ranks cannot import: put it in a "
                          ".py file (a script run as `python file.py` works) or a module you "
                          "import, or use backend='local'")


def booting() -> bool:
    """True while this rank loads the launcher's script: a ``launch`` now is an unguarded one."""
    return _state["booting"]


def load_main() -> bool:
    """Load the launcher's main script as ``__mp_main__``, aliased as ``__main__``; False if nothing
    to do."""
    spec = os.environ.get(ENV)
    if not spec or _state["loaded"]:
        return False
    _state["loaded"] = _state["booting"] = True
    kind, _, target = spec.partition(":")
    try:
        if kind == "module":
            namespace = runpy.run_module(target, run_name="__mp_main__", alter_sys=True)
        else:
            if os.path.dirname(target) not in sys.path:  # as `python script.py` sees its imports
                sys.path.insert(0, os.path.dirname(target))
            namespace = runpy.run_path(target, run_name="__mp_main__")
    finally:
        _state["booting"] = False
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    return True
