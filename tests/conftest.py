"""Shared fixtures: persistent worlds of the local backend, and the hypothesis profile.

Property tests run hundreds of examples over the shared-memory backend. Forking a
fresh world per example would spend the whole budget on process start-up, so the
session keeps one persistent ``World`` per world size, created on first use and
closed (ranks stopped, /dev/shm unlinked) when the session ends.

Functions sent to a persistent world with ``world.run(fn, *args)`` are pickled, so
they must live at module level; ``launch(fn, p)`` forks and takes any callable.

``DPLAB_EXAMPLES`` sets the base number of hypothesis examples (default 50); tests
that need more for a meaningful property scale it up.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from dplab.backends.launch.world import BACKENDS, BackendUnavailable, World, check_backend

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=False,
    max_examples=int(os.environ.get("DPLAB_EXAMPLES", "50")),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


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
