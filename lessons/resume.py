"""Where the learner stopped in each lesson, and how long each step took to run here.

    positions = Positions.load()          # $DPLAB_HOME/lessons.json, else ~/.cache/dplab/lessons.json
    positions.step(1)                     # 3: ``dplab lesson 1`` resumes at step 3; None: from the start
    positions.save(1, step=3, seconds={1: 2.4})
    positions.save(1, step=None)          # finished: the next run starts from the beginning

The file is a cache, never a reason to fail: one that is unreadable or not the expected JSON is
ignored with a one-line warning (``positions.warning``) and rewritten on the next save; one that
cannot be written is a warning too. The step times feed the progress bar's ETA and the listing's
estimated length.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["Positions", "store_path"]

FILE_NAME = "lessons.json"


def store_path() -> Path:
    """``$DPLAB_HOME/lessons.json`` when ``DPLAB_HOME`` is set, else ``~/.cache/dplab/lessons.json``."""
    home = os.environ.get("DPLAB_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "dplab") / FILE_NAME


class Positions:
    """The stored state of every lesson: ``{"lessons": {"1": {"step": 3, "seconds": {"1": 2.4}}}}``."""

    def __init__(self, path: Path, data: dict[str, Any], warning: str | None = None) -> None:
        self.path, self.data, self.warning = path, data, warning

    @classmethod
    def load(cls, path: Path | None = None) -> Positions:
        path = store_path() if path is None else path
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls(path, {"lessons": {}})
        except OSError as e:
            return cls(path, {"lessons": {}}, f"cannot read {path} ({e.strerror}): starting from step 1")
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or not isinstance(data.get("lessons"), dict) or not all(
                    isinstance(v, dict) for v in data["lessons"].values()):
                raise ValueError("not the expected {'lessons': {...}} object")
        except ValueError as e:  # JSONDecodeError is a ValueError
            reason = str(e).splitlines()[0][:80]
            return cls(path, {"lessons": {}}, f"ignoring {path}, which is corrupt ({reason}); "
                                              "it is rewritten on the next save")
        return cls(path, data)

    def _entry(self, lesson: int) -> dict[str, Any]:
        return self.data["lessons"].get(str(lesson), {})

    def step(self, lesson: int) -> int | None:
        """The 1-based step ``lesson`` resumes at, or None (never started, finished, or nonsense)."""
        step = self._entry(lesson).get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 1 else None

    def seconds(self, lesson: int) -> dict[int, float]:
        """Step number -> how long its run took last time here (what the ETA is made of)."""
        raw = self._entry(lesson).get("seconds", {})
        out = {}
        for k, v in (raw.items() if isinstance(raw, dict) else ()):
            if str(k).isdigit() and isinstance(v, (int, float)) and v >= 0:
                out[int(k)] = float(v)
        return out

    def save(self, lesson: int, step: int | None, seconds: dict[int, float] | None = None) -> str | None:
        """Record the position (None: finished) and step times; a failure is returned as a warning."""
        entry = dict(self._entry(lesson))
        if step is None:
            entry.pop("step", None)
        else:
            entry["step"] = step
        if seconds:
            merged = {**self.seconds(lesson), **seconds}
            entry["seconds"] = {str(k): round(v, 3) for k, v in sorted(merged.items())}
        self.data["lessons"][str(lesson)] = entry
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # atomic: a reader never sees half a file
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:  # never written (the folder is missing or is a file)
                pass
            return f"cannot save the position to {self.path} ({e.strerror})"
        return None
