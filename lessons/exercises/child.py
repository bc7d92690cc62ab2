"""The learner's code runs in a child process under limits; only plain data comes back to be judged.

    # the parent:
    data = run_learner("ring_reduce_scatter", file, {"world_sizes": [1, 2, 3]}, output)

The parent starts a fresh interpreter in its own session with a job file (exercise, learner's
file, inputs): the supervisor (``supervise``), a child subreaper that forks the child proper and
outlives it. The child sets its limits (``RLIMIT_AS``; a ``SIGALRM`` that raises ``TooLong``),
calls the learner's function through the exercise's collector (``COLLECTORS``) and writes JSON:
lists and numbers, bounded in size. The parent judges that data with its own, untouched checker.
Every way the child can end is one line: an answer, a ``Fail`` naming the learner's line, an exit,
a signal, a stop (SIGSTOP), the time limit (everything killed ``GRACE_S`` later if ``TooLong`` is
swallowed), a patching attempt. What it started dies with it, even past ``setsid()``
(``reaper.py``), its /dev/shm segments are unlinked, and its output is kept up to
``OUTPUT_CHARS``. The learner's ``os.getppid()`` is the supervisor, so stopping "the parent" stops
no dplab process. Honest verdicts and no hangs, not a sandbox against an attacker.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dplab.lessons.exercises.learner import CheckUnavailable, Fail, TooLong, clip, describe, limit_s
from dplab.lessons.exercises.reaper import become_subreaper, kill_below, stopped_below
from dplab.reference.errors import ConfigError

__all__ = ["COLLECTORS", "Patched", "GRACE_S", "OUTPUT_CHARS", "RESULT_BYTES", "MEMORY_MB",
           "memory_mb", "check_settings", "run_learner", "supervise", "main", "patched_since",
           "dplab_functions"]

# exercise -> "module:function": collector(file, inputs, out, deadline) fills ``out`` with plain
# data
COLLECTORS = {
    "ring_reduce_scatter": "dplab.lessons.exercises.ring:collect_ring",
    "ddp_buckets": "dplab.lessons.exercises.buckets:collect_buckets",
    "ssp_gate": "dplab.lessons.exercises.ssp:collect_ssp",
    "zero2_step": "dplab.lessons.exercises.zero2:collect_zero2",
    "ring_allgather": "dplab.lessons.exercises.schedules:collect_schedules",
    "tree_broadcast": "dplab.lessons.exercises.schedules:collect_schedules",
    "loss_scaler": "dplab.lessons.exercises.scaler:collect_scaler",
    "fsdp_unit": "dplab.lessons.exercises.fsdp_unit:collect_fsdp",
    "backup_step": "dplab.lessons.exercises.backup:collect_backup",
    "sharded_clip": "dplab.lessons.exercises.sharded_clip:collect_sharded_clip",
    "ddp_hooks": "dplab.lessons.exercises.ddp_hooks:collect_ddp_hooks",
    "fsdp_prefetch": "dplab.lessons.exercises.fsdp_prefetch:collect_fsdp_prefetch",
}
# after the time limit, how long the child has to report before it is killed
GRACE_S = 3.0
START_S = 60.0           # the child's own start (an interpreter and numpy), before its limit runs
OUTPUT_CHARS = 4000      # of what the learner's code prints, shown with the report
RESULT_BYTES = 16 << 20  # the answer's JSON: the largest exercise sends ~300 KB
# the child's address space (each of its ranks too): numpy and a world fit in 1 GB
MEMORY_MB = 4096
_STARTED = "started"
_CANNOT_ANSWER = 70  # the child's exit code when it could not write its answer (a full disk)


class Patched(Exception):
    """Raised by a collector whose ranks found dplab's functions replaced:
    ``args[0]`` names them."""


def memory_mb() -> int:
    """The child's memory limit in MiB: ``$DPLAB_CHECK_MEMORY_MB`` when set, else ``MEMORY_MB``.

    Raises:
        ConfigError: not a whole number from 256 to the most ``setrlimit`` takes here (its C long,
            or this process's own hard limit): the child would fail to set it, before any
            learner's line ran."""
    text = os.environ.get("DPLAB_CHECK_MEMORY_MB", "")
    most = _most_memory_mb()
    try:
        value = int(text) if text else MEMORY_MB
    except ValueError:
        value = 0
    if not 256 <= value <= most:
        raise ConfigError(f"DPLAB_CHECK_MEMORY_MB={text!r} must be a whole number of MiB from 256 "
                          f"to {most:,}: unset it or give e.g. {MEMORY_MB}")
    return value


def _most_memory_mb() -> int:
    """The largest RLIMIT_AS, in MiB, a child of this process can set."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    most = (1 << 63) - 1  # setrlimit takes a C long
    if hard != resource.RLIM_INFINITY:
        most = min(most, hard)
    return most >> 20


def check_settings() -> tuple[float, int]:
    """Every ``$DPLAB_CHECK_*`` setting, checked here in the parent before a child starts:
    (time limit in s, memory limit in MiB).

    Raises:
        ConfigError: one line naming the setting (a bad value, or a name no check reads)."""
    known = ("DPLAB_CHECK_LIMIT_S", "DPLAB_CHECK_MEMORY_MB")
    unknown = sorted(k for k in os.environ if k.startswith("DPLAB_CHECK_") and k not in known)
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a setting of dplab lesson check: the settings are "
                          f"{' and '.join(known)}; unset it")
    return limit_s(), memory_mb()


def run_learner(
    exercise: str, file: Path, inputs: dict[str, Any], output: list[str]
) -> dict[str, Any]:
    """Run ``exercise``'s collector on ``file`` in a child process; its plain data, or ``Fail``.

    What the learner's code printed is appended to ``output``. ``CheckUnavailable`` when the child
    could not run the check for a reason of the machine's."""
    file = Path(file)
    if not file.is_file():
        raise Fail(f"there is no {file.name} in {file.parent}: run `dplab lesson init "
                   f"{file.parent}` to get the stubs, then write your answer in {file.name}")
    limit, memory = check_settings()
    with tempfile.TemporaryDirectory(prefix="dplab-check-") as tmp:
        job = Path(tmp) / "job.json"
        result = Path(tmp) / "result.json"
        job.write_text(
            json.dumps(
                {
                    "exercise": exercise,
                    "file": str(file.resolve()),
                    "inputs": inputs,
                    "result": str(result),
                    "started": str(Path(tmp) / _STARTED),
                    "status": str(Path(tmp) / "status.json"),
                    "worker": str(Path(tmp) / "worker"),
                    "limit_s": limit,
                    "memory_mb": memory,
                }
            )
        )
        ended, code, printed, stopped = _run_child(job, Path(tmp), limit)
        if code == _CANNOT_ANSWER and not result.exists():
            last = printed.strip().splitlines()[-1] if printed.strip() else "no reason given"
            raise CheckUnavailable(f"cannot check {file.name} on this machine: {clip(last)}")
        output.append(printed)
        size = result.stat().st_size if result.is_file() else -1
        if size > RESULT_BYTES:
            raise Fail(f"{file.name}'s answer came back as {size:,} bytes: far more than the "
                       "exercise asks for")
        answer = json.loads(result.read_text()) if size >= 0 else None
    if answer is None:
        raise Fail(_no_answer(file, ended, code, limit, stopped))
    if answer.get("patched"):
        raise Fail(f"{file.name} replaced {', '.join(answer['patched'][:3])}: an answer is judged "
                   "by what its function returns, in another process, so patching dplab changes "
                   "nothing; remove that code")
    if answer.get("unavailable"):
        raise CheckUnavailable(answer["unavailable"])
    answer.setdefault("fail", None)
    return answer


def _no_answer(file: Path, ended: bool, code: int, limit: float, stopped: bool = False) -> str:
    """Why the child gave no answer, in one line."""
    if stopped:
        return (f"{file.name} stopped the check's process (SIGSTOP) and nothing let it go on: an "
                "exercise must not send signals to its own processes. It was killed at the check's "
                f"time limit of {limit:g} s, with everything it started")
    if not ended:
        return (f"{file.name} was still running {limit + GRACE_S:g} s in, {GRACE_S:g} s after the "
                f"check's time limit of {limit:g} s asked it to stop: does a loop catch every "
                "exception (a bare `except:` or `except BaseException`)? It was killed, with "
                "everything it started")
    if code >= 0:
        return (f"{file.name} ended the check's process with exit code {code} before answering: an "
                "exercise returns its answer; remove os._exit (or exit) from it")
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = {"SIGKILL": " (out of memory, most likely)", "SIGSEGV": " (a crash in native code)",
           "SIGBUS": " (a crash in native code, or a full /dev/shm)"}.get(name, "")
    return f"{file.name} ended the check's process with {name}{why} before answering"


def _run_child(job: Path, tmp: Path, limit: float) -> tuple[bool, int, str, bool]:
    """(ended by itself, the child's exit code, what it printed, stopped by a signal): the child and
    everything it started are gone when this returns, however it returns (a Ctrl-C here too)."""
    # sys.path[0] is the current folder under -c: a learner's numpy.py there must not shadow numpy
    code = ("import sys; sys.path.pop(0)\n"
            "from dplab.lessons.exercises.child import supervise; supervise(sys.argv[1])")
    env = {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
        # one BLAS thread: the exercises are tiny, and each thread's buffers count against
        # RLIMIT_AS
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, str(job)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    except OSError as e:
        raise CheckUnavailable(f"cannot start a Python process for the check: {e}") from None
    kept: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(proc.stdout, kept), daemon=True)
    reader.start()
    ended = stopped = False
    try:
        ended = _wait_unreaped(proc, tmp / _STARTED, limit)
        stopped = not ended and stopped_below(proc.pid)
    finally:
        _kill_all(proc.pid, tmp / "worker")  # the supervisor is not reaped yet: its ids are its own
        proc.wait()
        reader.join(timeout=2.0)
    printed = b"".join(kept).decode("utf-8", "replace")
    try:  # the child's own end, as the supervisor saw it; else the supervisor's (killed, likely)
        code = int(json.loads((tmp / "status.json").read_text())["code"])
    except (OSError, ValueError, KeyError, TypeError):
        code = proc.returncode
    return ended, code, printed, stopped


def _drain(stream: Any, kept: list[bytes]) -> None:
    """Read the child's output to its end, keeping the first ``OUTPUT_CHARS`` and counting the
    rest."""
    held, dropped = 0, 0
    while chunk := stream.read1(65536):
        if held < OUTPUT_CHARS:
            kept.append(chunk[:OUTPUT_CHARS - held])
            dropped += max(0, len(chunk) - (OUTPUT_CHARS - held))
            held += len(kept[-1])
        else:
            dropped += len(chunk)
    if dropped:
        kept.append(f"\n... ({dropped:,} more bytes of output)\n".encode())


def _wait_unreaped(proc: subprocess.Popen, started: Path, limit: float) -> bool:
    """Wait for the child to end without reaping it; False if it ran past its limit and grace."""
    deadline, nap, armed = time.monotonic() + START_S, 0.002, False
    while True:
        if _ended(proc):
            return True
        now = time.monotonic()
        if not armed and started.exists():  # the child's limit runs from here
            deadline, armed = now + limit + GRACE_S, True
        if now > deadline:
            return False
        time.sleep(nap)
        nap = min(nap * 2, 0.05)


def _ended(proc: subprocess.Popen) -> bool:
    if not hasattr(os, "waitid"):  # (macOS) poll reaps: the group id may be reused before the kill
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_all(pid: int, worker: Path) -> None:
    """SIGKILL the supervisor ``pid``, what is below it (setsid or not: it is their subreaper) and
    its session, and unlink the /dev/shm segments of the child's worlds."""
    kill_below(pid)  # the supervisor first stays: orphans of what is killed come back to it
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        launchers = {pid, int(worker.read_text())}
    except (OSError, ValueError):
        launchers = {pid}
    for launcher in launchers:
        _unlink_worlds(launcher)


def _unlink_worlds(launcher: int) -> None:
    try:
        from dplab.backends.local.shm import PREFIX, unlink_prefix

        unlink_prefix(f"{PREFIX}{launcher}_")  # a world's session is dplab_<launcher pid>_...
    except (ImportError, OSError):
        pass


# --- the supervisor -------------------------------------------------------------------------------

def supervise(job_path: str) -> None:
    """The check's first process: a child subreaper that forks the child (``main``), waits for it,
    then kills whatever it left behind and writes how it ended; never returns. An orphan of the
    learner's, in any session, comes back to this process, so it dies here and not at init."""
    job = json.loads(Path(job_path).read_text())
    become_subreaper()
    pid = os.fork()
    if pid == 0:
        main(job_path)  # never returns
    Path(job["worker"]).write_text(str(pid))
    while True:
        try:
            status = os.waitpid(pid, 0)[1]
            break
        except InterruptedError:
            continue
    kill_below(os.getpid())
    _unlink_worlds(pid)
    Path(job["status"]).write_text(json.dumps({"code": os.waitstatus_to_exitcode(status)}))
    os._exit(0)


# --- in the child ---------------------------------------------------------------------------------

def main(job_path: str) -> None:
    """The child: limits, the learner's code through the collector, the answer as JSON;
    never returns."""
    job = json.loads(Path(job_path).read_text())
    file, limit = Path(job["file"]), float(job["limit_s"])
    os.environ["DPLAB_CHECK_LIMIT_S"] = repr(limit)  # its ranks say the limit the parent set
    memory = int(job["memory_mb"]) << 20
    try:  # the machine's part, before any line of the learner's: a failure here is no verdict
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        module, name = COLLECTORS[job["exercise"]].split(":")
        collector: Callable[..., None] = getattr(importlib.import_module(module), name)
    except (ValueError, OverflowError, OSError, ImportError) as e:
        said = f"{type(e).__name__}: {clip(str(e))}"
        _answer(job, {"unavailable": f"cannot check {file.name} on this machine: the check's "
                                     f"process could not set up ({said})"})
    before = dplab_functions()
    me, out = os.getpid(), {}
    answer: dict[str, Any] = {"data": out}
    signal.signal(signal.SIGALRM, _too_long(limit))
    deadline = time.monotonic() + limit
    signal.setitimer(signal.ITIMER_REAL, limit)
    Path(job["started"]).touch()
    try:
        collector(file, job["inputs"], out, deadline)
    except Fail as e:
        answer["fail"] = clip(str(e), 2000)
    except TooLong as e:  # outside the learner's own frames: between calls, or waiting for ranks
        answer["fail"] = f"{file.name}: {e}"
    except MemoryError:
        answer["fail"] = (f"{file.name} used more memory than the check allows "
                          f"({job['memory_mb']:,} MiB; $DPLAB_CHECK_MEMORY_MB sets that): what "
                          "does it build that is so large?")
    except Patched as e:
        answer["patched"] = e.args[0]
    except CheckUnavailable as e:
        answer["unavailable"] = str(e)
    except (ConfigError, OSError) as e:  # the machine's: a full /dev/shm, no room for a world
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        answer["unavailable"] = f"cannot check {file.name} on this machine: {clip(said)}"
    except Exception as e:  # the learner's answer broke the collector itself
        answer["fail"] = (describe(e, file, f"checking {file.name}") + " (the checker could not "
                                                                       "judge this "
                          "answer: report it if it looks right)")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if os.getpid() != me:  # a fork of the learner's got here: only the child answers
        os._exit(0)
    answer["patched"] = sorted({*answer.get("patched", ()), *patched_since(before, file)})
    _answer(job, answer)


def _answer(job: dict[str, Any], answer: dict[str, Any]) -> None:
    """Write the answer where the parent reads it, and end the child (never returns)."""
    tmp = Path(job["result"] + ".tmp")
    try:
        tmp.write_text(json.dumps(answer))
        os.replace(tmp, job["result"])
    except OSError as e:
        print(f"cannot write the answer to {tmp} ({e.strerror or e})", flush=True)
        os._exit(_CANNOT_ANSWER)
    sys.stdout.flush()
    os._exit(0)  # no atexit handler of the learner's runs after the answer


def _too_long(limit: float) -> Callable[[int, Any], None]:
    def stop(signum: int, frame: Any) -> None:
        raise TooLong(f"still running after {limit:g} s: does a loop never end?")

    return stop


def dplab_functions() -> dict[tuple[str, str], Any]:
    """(module, name) -> every function and class the loaded ``dplab`` modules hold."""
    out = {}
    for mod_name, mod in list(sys.modules.items()):
        if (mod_name == "dplab" or mod_name.startswith("dplab.")) and isinstance(
            mod, types.ModuleType
        ):
            for attr, value in list(vars(mod).items()):
                if isinstance(value, (types.FunctionType, type)):
                    out[mod_name, attr] = value
    return out


def patched_since(before: dict[tuple[str, str], Any], file: Path) -> list[str]:
    """``module.name`` of every dplab function replaced since ``before``, or set to one of
    ``file``'s."""
    now = dplab_functions()
    changed = {k for k, v in before.items() if now.get(k, v) is not v}
    for mod_name, mod in list(sys.modules.items()):
        if mod_name == "dplab" or mod_name.startswith("dplab."):
            for attr, value in list(getattr(mod, "__dict__", {}).items()):
                code = getattr(value, "__code__", None)
                if code is not None and _same_file(code.co_filename, file):
                    changed.add((mod_name, attr))
    return sorted(f"{m}.{a}" for m, a in changed)


def _same_file(a: str, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except (OSError, ValueError):
        return False
