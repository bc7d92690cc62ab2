"""Shared fixtures: persistent worlds of the local backend, and the hypothesis profile.

Property tests run hundreds of examples over the shared-memory backend. Forking a
fresh world per example would spend the whole budget on process start-up, so the
session keeps one persistent ``World`` per world size, created on first use and
closed (ranks stopped, /dev/shm unlinked) when the session ends.

Functions sent to a persistent world with ``world.run(fn, *args)`` are pickled, so
they must live at module level; ``launch(fn, p)`` forks and takes any callable.

``DPLAB_EXAMPLES`` sets the base number of hypothesis examples (default 50); tests
that need more for a meaningful property scale it up.

``DPLAB_CPU_LOG=PATH`` appends one line per test: its node id, wall seconds, CPU seconds
(this process, its reaped children, and its live descendants such as a persistent world's
ranks), the 1-minute load average, this process's own CPU seconds (what one core must do
in turn, whatever the others do), the xdist worker and the Unix time the test ended: where the
suite's time goes on a shared machine, where wall times are inflated by others' work but CPU
seconds are not, and how the two workers' lanes end (the run waits for the later one).
``DPLAB_SUITE_RECORD=PATH`` writes the whole run's record (its command, tests passed, wall and CPU
seconds, load, cores) as JSON: ``tests/suite_time.json`` is one, and the README's test times are
read from it (``tests/test_readme.py`` checks them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kernels  # tests/kernels.py, beside this file
import pytest

kernels.pin()  # before NumPy loads: the recorded bits are those of one set of kernels

from hypothesis import HealthCheck, settings  # noqa: E402 - after the pin: these load NumPy

from dplab.backends.launch.world import (  # noqa: E402
    BACKENDS,
    BackendUnavailable,
    World,
    check_backend,
)

# pytest rewrites every test module's asserts (AST walks: ~10 CPU-s for this suite) in every
# process that collects it, each xdist worker among them, and caches the result as a .pyc, unless
# the environment sets PYTHONDONTWRITEBYTECODE (this machine's does): then every run pays it again.
# The cache lives in tests/__pycache__, which git ignores.
sys.dont_write_bytecode = False

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=False,
    max_examples=int(os.environ.get("DPLAB_EXAMPLES", "50")),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


def _tree_cpu() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (from /proc)."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    tick, stack, seen = os.sysconf("SC_CLK_TCK"), [os.getpid()], set()
    while stack:
        pid = stack.pop()
        kids = []
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            if kid in seen:
                continue
            seen.add(kid)
            stack.append(kid)
            try:  # utime, stime, cutime, cstime: fields 14-17
                with open(f"/proc/{kid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += sum(int(f) for f in fields[11:15]) / tick
            except (OSError, IndexError, ValueError):
                pass
    return total


# This session's, taken out of the environment: a test that runs pytest in a subprocess must not
# log into this run's files (nor overwrite its record). xdist's workers, which run the tests, get
# the log's path under a name of their own (pytest_configure), and take it out in turn.
_CPU_LOG = os.environ.pop("DPLAB_CPU_LOG", "") or os.environ.pop("DPLAB_CPU_LOG_WORKER", "")
_RECORD = os.environ.pop("DPLAB_SUITE_RECORD", "")


def pytest_configure(config: pytest.Config) -> None:
    if _CPU_LOG and getattr(config.option, "numprocesses", None) and \
            not hasattr(config, "workerinput"):  # xdist's controller: its workers start after this
        os.environ["DPLAB_CPU_LOG_WORKER"] = _CPU_LOG


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = _CPU_LOG
    if not path:
        yield
        return
    own, cpu, wall = time.process_time(), _tree_cpu(), time.monotonic()
    yield
    cpu, wall, own = _tree_cpu() - cpu, time.monotonic() - wall, time.process_time() - own
    with open(path, "a") as f:
        f.write(f"{item.nodeid}\t{wall:.3f}\t{cpu:.3f}\t{os.getloadavg()[0]:.2f}\t{own:.3f}\t"
                f"{os.environ.get('PYTEST_XDIST_WORKER', '-')}\t{time.time():.1f}\n")


_START: dict[str, float] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    if _RECORD:
        _START.update(wall=time.monotonic(), cpu=_tree_cpu(), load=os.getloadavg()[0])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``DPLAB_SUITE_RECORD=PATH``: this run's record, kept in PATH under its command (the
    README's two test commands each have one there: ``tests/test_readme.py`` reads them)."""
    path = _RECORD
    if not path or not _START:
        return
    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    count = {
        k: len([r for r in stats.get(k, []) if r.when == "call"]) for k in ("passed", "failed")
    }
    count |= {"skipped": len(stats.get("skipped", [])), "errors": len(stats.get("error", []))}
    command = "pytest" + "".join(f' "{a}"' if " " in a else f" {a}" for a in sys.argv[1:])
    record = {"markexpr": session.config.option.markexpr, **count,
              "wall_s": round(time.monotonic() - _START["wall"], 1),
              "cpu_s": round(_tree_cpu() - _START["cpu"], 1),
              "load_1min": [round(_START["load"], 2), round(os.getloadavg()[0], 2)],
              "cores": len(os.sched_getaffinity(0)),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    records = {}
    if os.path.exists(path):
        with open(path) as f:
            records = json.load(f)
    records[command] = record
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def _names_mpi(nodeid: str) -> bool:
    """Does the test's file name or its parameters' id (``test_x[mpi-4-ring]``) name MPI?"""
    file, _, test = nodeid.partition("::")
    words = file.rsplit("/", 1)[-1].removesuffix(".py").split("_")
    params = test.rsplit("[", 1)[1].rstrip("]").split("-") if test.endswith("]") else []
    return "mpi" in words + params


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (pyproject's addopts), except that the files with a test on MPI share
    one worker. Each worker keeps its own session worlds, and an MPI world's ranks are fresh
    interpreters that each import NumPy, mpi4py, torch and the tests' modules (4-6 CPU-s a rank):
    split over two workers each such world was started twice (issue 28). (xdist's ``loadgroup``
    would say this with marks, but under pytest 9 its node-id suffix no longer takes: it runs as
    ``load``, a test at a time.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class MpiFilesTogether(LoadFileScheduling):
        mpi_files: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            if self.mpi_files is None:  # the workers' collection is complete when scopes are asked
                collection = next(iter(self.registered_collections.values()))
                self.mpi_files = {n.split("::", 1)[0] for n in collection if _names_mpi(n)}
            return "mpi-files" if file in self.mpi_files else file

    return MpiFilesTogether(config, log)


def _backend_params() -> list:
    return [
        pytest.param(name, marks=[] if name == "local" else [getattr(pytest.mark, name)], id=name)
        for name in BACKENDS
    ]


@pytest.fixture(scope="session", params=_backend_params())
def backend(request: pytest.FixtureRequest) -> str:
    """Each installed backend in turn (the conformance suite);
    a missing one skips with its reason."""
    try:
        check_backend(request.param)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    return request.param


@pytest.fixture(autouse=True)
def _fresh_streamlit_cache() -> Iterator[None]:
    """``st.cache_data`` is shared by every AppTest in the process: each test starts and ends with
    it empty, so one page's cached runs never answer another test's question."""
    import sys

    st = sys.modules.get("streamlit")  # only where a test has imported it: no cost elsewhere
    if st is not None:
        st.cache_data.clear()
    yield
    if (st := sys.modules.get("streamlit")) is not None:
        st.cache_data.clear()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Callable[..., World]]:
    """``get_world(p, backend="local")``: the session's persistent world of ``p`` ranks (created
    lazily)."""
    cache: dict[tuple[int, str], World] = {}

    def get_world(p: int, backend: str = "local") -> World:
        if (p, backend) not in cache:
            # A shorter timeout than the library default: a hang fails fast, not in a minute.
            cache[(p, backend)] = World(
                p, backend, timeout=float(os.environ.get("DPLAB_TIMEOUT", "30"))
            )
        return cache[(p, backend)]

    try:
        yield get_world
    finally:
        # All at once: an MPI world takes ~1 s to stop (mpiexec's own wait), and the session ends
        # with one world per size and backend (~20): one after another that was 10-25 s of teardown.
        with ThreadPoolExecutor(max_workers=max(1, len(cache))) as pool:
            list(pool.map(World.close, cache.values()))


@pytest.fixture
def cli_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., Any]:
    """``cli_here(*argv)``: ``dplab *argv`` run by ``main`` in this process, as a CompletedProcess
    (returncode, stdout, stderr). A subprocess costs ~0.45 s of interpreter start and imports per
    call; this costs milliseconds. Starting a rank is an error here: every refusal it is used for
    must come before any rank starts (a World may check its arguments, as for --world-size 0).
    Tests of what only a real process shows (the module's exit code, no warning printed at import)
    keep a subprocess for one case per command."""
    from dplab.backends.cli.commands import main
    from dplab.backends.launch import world

    def no_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("dplab started ranks: the refusal must come before any rank starts")

    monkeypatch.setattr(world, "start_ranks", no_ranks)
    monkeypatch.setenv("DPLAB_DEVICE", "")  # main sets it for --device: put back as it was after
    monkeypatch.delenv("DPLAB_DEVICE")

    def run(*argv: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(argv), code, out, err)

    return run
