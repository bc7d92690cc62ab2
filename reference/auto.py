"""``algorithm="auto"``: per call, the all-reduce that the fitted cost model says is fastest here.

    allreduce(comm, grads, algorithm="auto")    # anywhere an all-reduce algorithm is accepted
    dplab tune --backends local,mpi             # measure, fit and save what auto reads
    choose("mpi", 4, 1 << 20)                   # what auto runs for 1 MiB on 4 MPI ranks

Candidates are the registered all-reduces (``ALLREDUCE``) and ``native`` where the fit has native
rows, priced by the most specific fit for (backend, world size, bytes) and scaled to the
measurement at benchmarked sizes; ties go by registry order. The fit is read once from
``$DPLAB_TUNE``, else ``~/.cache/dplab/tune.json``, else ``DEFAULT_FITS`` (``reset()`` rereads); a
backend with no fit runs ``native``. On several hosts ``hierarchical`` is a candidate only as
``hierarchical:<ranks per host>``, and a two-level fit prices schedules on its ``Topology``.
Every rank computes the same choice from the same inputs (ranks that disagree get a
``CollectiveMismatch``), cached per (backend, world size, bytes, itemsize).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from dplab.reference.algorithms import ALLREDUCE, allreduce_schedule
from dplab.reference.algorithms.layout import node_size
from dplab.reference.costfit import CostFit
from dplab.reference.errors import ConfigError, DplabError
from dplab.reference.files import read_regular, write_atomic
from dplab.reference.topology import Link, Topology

__all__ = ["TUNE_ENV", "DEFAULT_TUNE_PATH", "DEFAULT_FITS", "NATIVE_CHECK", "Tuning", "tune_path",
           "load_tuning", "save_tuning", "current", "choose", "chosen", "choose_on", "backend_key",
           "node_key", "reset", "LEVELS"]

TUNE_ENV = "DPLAB_TUNE"
TUNE_MAX_BYTES = 64 << 20  # a fit of every cell of a large bench is well under a megabyte
DEFAULT_TUNE_PATH = "~/.cache/dplab/tune.json"
_ALL = "all"
REDO = "run `dplab tune` again to rewrite it"  # ends every bad-file line
_VALUES = ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte")  # a saved fit's numbers
LEVELS = ("intra", "inter")  # a two-level fit's links: inside a host, between hosts
ONE_HOST, SCATTERED = 0, -1  # node_key's layouts other than g consecutive ranks per host
# dplab's native all-reduce first checks every rank's (length, dtype) where the engine cannot
# carry our check (the local backend's is a tag): on MPI ceil(log2 p) rounds of 32-byte messages,
# on gloo and NCCL a MAX all-reduce of 4 int64s. auto pays it, so prices it as a native
# all-reduce of 32 bytes
NATIVE_CHECK = (("mpi", "torch", "torch-nccl"), 32, 8)

# (backend, world_size, algorithm, alpha s, beta s/B, gamma s/B): the per-backend fits of
# `dplab tune --backends local,mpi,torch --world-sizes 2,4 --sizes 4K,64K,1M,16M` on the machine
# dplab was written on (2 cores, shared: load 3-8 from other work; 2026-11-23), every registered
# schedule and native benched. rms residuals 46% (local), 65% (mpi), 62% (torch): a rough guide,
# so run `dplab tune` on your machine. beta came out 0 on all three: there every byte moved
# costs about what a reduced byte does, and the non-negative fit puts it all in gamma.
DEFAULT_FITS: tuple[tuple[str, Any, str, float, float, float | None], ...] = (
    ("local", _ALL, _ALL, 43.9e-6, 0.0, 1 / 5.84e9),
    ("local", _ALL, "native", 94.7e-6, 1 / 5.18e9, None),
    ("mpi", _ALL, _ALL, 19.3e-6, 0.0, 1 / 1.49e9),
    ("mpi", _ALL, "native", 8.79e-6, 1 / 1.42e9, None),
    ("torch", _ALL, _ALL, 421e-6, 0.0, 1 / 1.02e9),
    ("torch", _ALL, "native", 455e-6, 1 / 1.34e9, None),
)


@dataclass(frozen=True)
class Tuning:
    """The fits auto chooses from, and where they came from (a path, or "built-in defaults").

    Args:
        fits: the fitted groups.
        source: where they came from.
        measured: (backend, world size, algorithm, bytes, seconds) as ``dplab tune`` measured them,
            or None to read them off the fits' rows.
        links: (backend, level, alpha, beta, gamma) of a two-level fit, if one was made.
    """

    fits: tuple[CostFit, ...]
    source: str = "built-in defaults"
    # (backend, world size, algorithm, bytes, seconds): what `dplab tune` measured; None:
    # its fits' rows
    measured: tuple[tuple[str, int, str, int, float], ...] | None = None
    # (backend, level in LEVELS, alpha s, beta s/B, gamma s/B): a two-level fit, where one was made
    links: tuple[tuple[str, str, float, float, float], ...] = ()

    def topology(self, backend: str, ranks_per_node: int) -> Topology | None:
        """The two-level topology of ``backend``'s links for hosts of ``ranks_per_node``, or None
        (no intra and inter fit for it). gamma: the inter fit's (reductions run on the same
        cores).

        Args:
            backend: the fit's backend ("local", "mpi", "torch", ...).
            ranks_per_node: ranks per host.

        Returns:
            The topology, or None.
        """
        got = {level: (a, b, c) for be, level, a, b, c in self.links if be == backend}
        if set(LEVELS) - set(got):
            return None
        (ia, ib, _), (xa, xb, gamma) = got["intra"], got["inter"]
        return Topology(f"{backend}-tuned", ranks_per_node, Link(ia, ib), Link(xa, xb), gamma,
                        f"two-level fit of {self.source}")

    def cells(self) -> tuple[tuple[str, int, str, int, float], ...]:
        """The measured cells (``measured``, else read off the per-algorithm fits' rows).

        Returns:
            (backend, world size, algorithm, bytes, seconds) per measured cell.
        """
        if self.measured is not None:
            return self.measured
        return tuple(
            (f.backend, int(r["world_size"]), f.algorithm, int(r["bytes"]), r["time_us"] * 1e-6)
            for f in self.fits
            if f.algorithm != _ALL and str(f.world_size) != _ALL
            for r in f.rows
            if r.get("time_us")
        )

    def fit_for(self, backend: str, algorithm: str, world_size: int) -> CostFit | None:
        """The most specific fit that prices ``algorithm`` (module docstring), or None.

        Args:
            backend: the fit's backend.
            algorithm: the all-reduce to price.
            world_size: the number of ranks.

        Returns:
            The fit, or None when none prices it.
        """
        keys = [(world_size, algorithm), (_ALL, algorithm)]
        if algorithm != "native":
            keys += [(world_size, _ALL), (_ALL, _ALL)]
        for p, alg in keys:
            for f in self.fits:
                if (f.backend == backend and f.algorithm == alg and f.alpha is not None
                        and str(f.world_size) == str(p)):
                    return f
        return None

    def predict_s(self, backend: str, algorithm: str, world_size: int, nbytes: int,
                  itemsize: int = 4) -> float | None:
        """Seconds for one all-reduce as ``allreduce(..., algorithm)`` runs it (``native``: with its
        shape check where that is one more engine all-reduce, ``NATIVE_CHECK``).

        Args:
            backend: the fit's backend.
            algorithm: the all-reduce.
            world_size: the number of ranks.
            nbytes: the buffer's bytes.
            itemsize: bytes per element.

        Returns:
            Seconds, or None when no fit prices it.
        """
        f = self.fit_for(backend, algorithm, world_size)
        if f is None:
            return None
        t = self._corrected(f, backend, algorithm, world_size, nbytes, itemsize)
        if algorithm == "native" and backend in NATIVE_CHECK[0]:
            t += self._corrected(f, backend, algorithm, world_size, *NATIVE_CHECK[1:])
        return t

    def _corrected(self, f: CostFit, backend: str, algorithm: str, world_size: int, nbytes: int,
                   itemsize: int) -> float:
        """The fit's time, scaled by measured / fitted at the measured size nearest ``nbytes`` (by
        ratio) of this very cell, if ``dplab tune`` measured it: a benchmarked size is priced at
        what was measured there. (Three or four parameters fitted to a loaded machine's rows missed
        them by 12-60%, enough to rank schedules 2x apart the wrong way round.)"""
        t = f.predict_s(algorithm, world_size, nbytes, itemsize)
        near = [
            (abs(math.log2(max(b, 1) / max(nbytes, 1))), b, s)
            for be, p, a, b, s in self._cells()
            if be == backend and p == world_size and a == algorithm
        ]
        if near and t > 0:
            _, b, s = min(near)
            fitted = f.predict_s(algorithm, world_size, b, itemsize)
            t *= s / fitted if fitted > 0 else 1.0
        return t

    def _cells(self) -> tuple[tuple[str, int, str, int, float], ...]:
        cached = self.__dict__.get("_cells_cache")
        if cached is None:
            cached = self.cells()
            object.__setattr__(self, "_cells_cache", cached)
        return cached

    def candidates(self, backend: str, node: int = ONE_HOST) -> list[str]:
        """The registered all-reduces, then ``native`` if this backend has a fit for it. Where some
        were measured (a fit of their own), only those: the others would be priced by the coarse
        fit alone, 25-35% rms off on the machine this was written on, against measured rivals
        (``dplab tune`` benches every registered one, so a new algorithm joins at the next tune).

        Args:
            backend: the fit's backend.
            node: the hosts' layout (``node_key``).

        Returns:
            Algorithm names, in registry order.
        """
        mine = {f.algorithm for f in self.fits if f.backend == backend and f.alpha is not None}
        ours = [a for a in ALLREDUCE if a in mine] or list(ALLREDUCE)
        if node != ONE_HOST:  # several hosts: hierarchical only as the schedule that matches them
            ours = [f"{a}:{node}" if a == "hierarchical" else a for a in ours
                    if a != "hierarchical" or node > 0]
        return [*ours, *(["native"] if "native" in mine else [])]

    def choose(self, backend: str, world_size: int, nbytes: int, itemsize: int = 4,
               node: int = ONE_HOST) -> str:
        """The candidate with the least predicted time; ``native`` where nothing is fitted.
        ``node``: the hosts (``node_key``); with several and a two-level fit, priced on its
        topology.

        Args:
            backend: the fit's backend.
            world_size: the number of ranks.
            nbytes: the buffer's bytes.
            itemsize: bytes per element.
            node: the hosts' layout (``node_key``).

        Returns:
            The algorithm to run.

        Raises:
            ConfigError: the fit prices a candidate at a time that is not finite.
        """
        best: tuple[float, int, str] | None = None
        topo = self.topology(backend, node) if node > 0 else None
        for i, alg in enumerate(self.candidates(backend, node)):
            if topo is not None and alg == "native":
                continue
            try:
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
                    t = (self.predict_s(backend, alg, world_size, nbytes, itemsize) if topo is None
                         else _walk(allreduce_schedule(alg, world_size), nbytes, itemsize, topo))
            except DplabError:  # a schedule that cannot be built at this world size is no candidate
                continue
            except (ArithmeticError, ValueError):  # inf - inf inside the model: a nan price
                t = math.nan
            if t is not None and not math.isfinite(t):
                raise ConfigError(f"{self.source}: the fit for {backend} prices {alg} on "
                                  f"{world_size} ranks at {t} s for {nbytes} bytes: {REDO}")
            if t is not None and (best is None or (t, i) < best[:2]):
                best = (t, i, alg)
        return "native" if best is None else best[2]

    def to_json(self) -> dict[str, Any]:
        """The tuning as JSON-ready data: what ``save_tuning`` writes and ``from_json`` reads.

        Returns:
            A dict with the version, the fits, the measured cells and any two-level links.
        """
        out = {"version": 1, "fits": [f.to_json() for f in self.fits],
               "measured": [list(c) for c in self.cells()]}
        if self.links:
            out["links"] = [dict(zip(("backend", "level", *_VALUES), link)) for link in self.links]
        return out

    @classmethod
    def from_json(cls, data: Any, source: str) -> Tuning:
        """The tuning in ``data`` (``to_json``'s form), every number checked: a value no ``dplab
        tune`` writes (negative, NaN, a string) would make auto pick one schedule everywhere or fail
        on every rank at its first all-reduce, so it is refused here, in one line.

        Args:
            data: parsed JSON.
            source: where it came from, for the messages.

        Returns:
            The tuning.

        Raises:
            ConfigError: anything ``dplab tune`` would not have written, in one line.
        """
        try:
            if data.get("version") != 1:
                raise ConfigError(f"{source}: unknown tune file version {data.get('version')!r}: "
                                  f"{REDO}")
            fits, measured = data["fits"], data.get("measured", [])
            if not isinstance(fits, list) or not isinstance(measured, list):
                raise ConfigError(f"{source}: 'fits' and 'measured' must be lists: {REDO}")
            for i, f in enumerate(fits):
                _check_fit(f, f"{source}: fits[{i}]")
            for i, m in enumerate(measured):
                _check_cell(m, f"{source}: measured[{i}]")
            links = data.get("links", [])
            for i, link in enumerate(links if isinstance(links, list) else [links]):
                _check_link(link, f"{source}: links[{i}]")
            tuning = cls(tuple(CostFit.from_json(f) for f in fits), source,
                         tuple((b, p, a, n, float(t)) for b, p, a, n, t in measured),
                         tuple((k["backend"], k["level"], *(float(k[v]) for v in _VALUES))
                               for k in links))
            _check_prices(tuning)
            return tuning
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(
                f"{source} is not a file written by `dplab tune` ({e!r}): {REDO}"
            ) from None


def _bad(where: str, value: Any, want: str) -> ConfigError:
    shown = repr(value)
    return ConfigError(f"{where} is {shown if len(shown) <= 40 else shown[:37] + '...'}, not "
                       f"{want}: {REDO}")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_fit(f: Any, where: str) -> None:
    """One saved fit: names are strings, world_size a rank count or "all", each value None (not
    fitted) or a finite number >= 0, and a fitted one not all zero (that prices every schedule at
    0 s, so the first registered would win everywhere)."""
    if not isinstance(f, dict):
        raise _bad(where, f, "a fit (an object)")
    for key in ("backend", "algorithm"):
        if not isinstance(f[key], str):
            raise _bad(f"{where}.{key}", f[key], "a name")
    ws = f["world_size"]
    if ws != _ALL and not (type(ws) is int and ws >= 1):
        raise _bad(f"{where}.world_size", ws, f"a rank count or {_ALL!r}")
    where = f"{where} ({f['backend']}, {ws}, {f['algorithm']})"
    for key in _VALUES:
        v = f[key]
        if v is not None and not (_real(v) and math.isfinite(v) and v >= 0):
            raise _bad(f"{where}.{key}", v, "a finite number >= 0")
    if f["alpha_s"] is not None and not any(f[key] for key in _VALUES):
        raise ConfigError(f"{where}: alpha_s, beta_s_per_byte and gamma_s_per_byte are all 0, "
                          f"which prices every all-reduce at 0 s: {REDO}")


def _check_link(link: Any, where: str) -> None:
    """One link of a two-level fit: a backend, a level of LEVELS, three finite numbers >= 0."""
    if not isinstance(link, dict):
        raise _bad(where, link, "a link (an object)")
    if not isinstance(link["backend"], str):
        raise _bad(f"{where}.backend", link["backend"], "a name")
    if link["level"] not in LEVELS:
        raise _bad(f"{where}.level", link["level"], " or ".join(map(repr, LEVELS)))
    for key in _VALUES:
        v = link[key]
        if not (_real(v) and math.isfinite(v) and v >= 0):
            raise _bad(f"{where}.{key}", v, "a finite number >= 0")


PROBE_BYTES = 1 << 20  # the all-reduce every fit must price at a finite time when the file is read


def _check_prices(t: Tuning) -> None:
    """Fields that are finite can still price nothing finite: alpha_s 1e308 times two messages is
    inf, and the fit's own slope then inf - inf. Every price the file derives is checked here: each
    fit's at one all-reduce of ``PROBE_BYTES`` on the most ranks it was measured on, the fitted
    time of every measured cell and the scale factor taken from it, each link's ring on two
    hosts. A price at a world size no file can foresee ``choose`` checks when it prices."""
    def finite(price: Any, *args: Any) -> float:
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the finding
                value = float(price(*args))
        except DplabError:  # an algorithm this dplab does not have: never a candidate, never priced
            return 1.0
        except (ArithmeticError, ValueError):
            value = math.nan
        return value if math.isfinite(value) else math.nan

    for f in t.fits:
        if f.alpha is None:
            continue
        sizes = [p for b, p, *_ in t.cells() if b == f.backend] or [2]
        p = max(sizes) if str(f.world_size) == _ALL else int(f.world_size)
        alg = "ring" if f.algorithm == _ALL else f.algorithm
        value = finite(f.predict_s, alg, p, PROBE_BYTES)
        if math.isnan(value):
            raise ConfigError(f"{t.source}: the fit ({f.backend}, {f.world_size}, {f.algorithm}) "
                              f"prices a {PROBE_BYTES >> 20} MiB {alg} on {p} ranks at no finite "
                              f"time (alpha_s {f.alpha:g}, beta {f.beta}, gamma {f.gamma}): {REDO}")
    for b, p, a, n, s in t.cells():
        f = t.fit_for(b, a, p)
        fitted = finite(f.predict_s, a, p, n) if f is not None else 1.0
        if math.isnan(fitted) or (fitted > 0 and not math.isfinite(s / fitted)):
            raise ConfigError(f"{t.source}: the measured cell ({b}, {p}, {a}, {n} B) takes "
                              f"{s:g} s, the fit prices it at {fitted:g} s: no finite scale "
                              f"between them: {REDO}")
    for backend in {link[0] for link in t.links}:
        topo = t.topology(backend, 2)
        if topo is not None and math.isnan(finite(_walk, allreduce_schedule("ring", 4),
                                                  PROBE_BYTES, 4, topo)):
            raise ConfigError(f"{t.source}: the two-level fit of {backend} prices a ring on two "
                              f"hosts at no finite time: {REDO}")


def _walk(schedule: Any, nbytes: int, itemsize: int, topo: Topology) -> float:
    """Seconds the cost model gives ``schedule`` on ``topo`` (imported here: only a multi-host
    choice with a two-level fit walks schedules)."""
    from dplab.reference.costmodel import cost

    return cost(schedule, nbytes, itemsize=itemsize, topology=topo).time


def _check_cell(m: Any, where: str) -> None:
    """One measured cell: [backend, world size >= 1, algorithm, bytes >= 0, seconds > 0, finite]."""
    if not (isinstance(m, list) and len(m) == 5):
        raise _bad(where, m, "[backend, world_size, algorithm, bytes, seconds]")
    b, p, a, n, t = m
    for name, v in (("backend", b), ("algorithm", a)):
        if not isinstance(v, str):
            raise _bad(f"{where} {name}", v, "a name")
    for name, v, least in (("world_size", p, 1), ("bytes", n, 0)):
        if not (type(v) is int and v >= least):
            raise _bad(f"{where} {name}", v, f"a whole number >= {least}")
    if not (_real(t) and math.isfinite(t) and t > 0):
        raise _bad(f"{where} ({b}, {p}, {a}, {n} B) seconds", t, "a measured time > 0")


def tune_path() -> Path:
    """``$DPLAB_TUNE`` if set, else ``~/.cache/dplab/tune.json``.

    Returns:
        The path auto reads its fit from.
    """
    return Path(os.environ.get(TUNE_ENV) or DEFAULT_TUNE_PATH).expanduser()


def _defaults() -> Tuning:
    return Tuning(tuple(CostFit(b, p, a, alpha, beta, gamma, (), "built-in default")
                        for b, p, a, alpha, beta, gamma in DEFAULT_FITS))


def load_tuning(path: str | Path | None = None) -> Tuning:
    """The saved fit at ``path`` (default ``tune_path()``); the built-in defaults if there is
    none.

    Args:
        path: a tune file, or None for ``tune_path()``.

    Returns:
        The tuning.

    Raises:
        ConfigError: a named file (or ``$DPLAB_TUNE``) that is missing, not a regular file,
            unreadable, or not a file ``dplab tune`` wrote.
    """
    where = Path(path).expanduser() if path is not None else tune_path()
    if not where.exists():
        if path is not None or os.environ.get(TUNE_ENV):
            raise ConfigError(f"no tune file at {where}: run `dplab tune --out {where}` first")
        return _defaults()
    if not where.is_file():  # a FIFO or a device would block or never end
        raise ConfigError(f"the tune file {where} is not a regular file: {REDO}")
    try:
        data = json.loads(read_regular(where, TUNE_MAX_BYTES, "the tune file"))
    except ConfigError as e:  # grew or changed kind since the check above
        raise ConfigError(f"{e}: {REDO}") from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, or not UTF-8
        raise ConfigError(f"cannot read the tune file {where} ({e}): {REDO}") from None
    return Tuning.from_json(data, str(where))


def save_tuning(tuning: Tuning, path: str | Path | None = None) -> Path:
    """Write ``tuning`` where auto reads it (default ``tune_path()``), atomically;
    returns the path.

    Args:
        tuning: the fit.
        path: where to write, or None for ``tune_path()``.

    Returns:
        The path written.

    Raises:
        WriteError: the file cannot be written.
    """
    where = Path(path).expanduser() if path is not None else tune_path()
    where.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(where, json.dumps(tuning.to_json(), indent=1).encode(), "the tune file")
    return where


@lru_cache(maxsize=1)
def current() -> Tuning:
    """The fit this process chooses with: read once (``reset()`` reads it again).

    Returns:
        The tuning (``load_tuning()``'s, cached).
    """
    return load_tuning()


@lru_cache(maxsize=4096)
def choose(
    backend: str, world_size: int, nbytes: int, itemsize: int = 4, node: int = ONE_HOST
) -> str:
    """What ``algorithm="auto"`` runs for one all-reduce of ``nbytes`` on ``world_size`` ranks
    placed as ``node`` says (``node_key``).

    Args:
        backend: the fit's backend.
        world_size: the number of ranks.
        nbytes: the buffer's bytes.
        itemsize: bytes per element.
        node: the hosts' layout (``node_key``).

    Returns:
        The algorithm to run (cached per arguments).
    """
    return current().choose(backend, world_size, nbytes, itemsize, node)


@lru_cache(maxsize=64)
def node_key(hosts: tuple[int, ...] | None) -> int:
    """The layout as auto's cache key: ``ONE_HOST`` (0), g (several hosts of g consecutive ranks,
    the last possibly smaller), or ``SCATTERED`` (-1: several hosts, ranks not in blocks).

    Args:
        hosts: each rank's host key, or None.

    Returns:
        The layout as an integer.
    """
    if not hosts or max(hosts) == 0:
        return ONE_HOST
    return node_size(hosts) or SCATTERED


def backend_key(comm: Any) -> str:
    """The fit's backend for ``comm``: its ``backend`` ("local", "mpi", "torch"), "torch-nccl" on
    GPUs.

    Args:
        comm: the communicator.

    Returns:
        The backend's name as the fits name it.
    """
    name = getattr(comm, "backend", "") or "unknown"
    return "torch-nccl" if name == "torch" and getattr(comm, "nccl", False) else name


def chosen(comm: Any, buf: Any) -> str:
    """What auto runs for ``buf`` (a numpy array or torch tensor, any shape) on ``comm``; on a
    simulated cluster with no fit of its own, the schedule its cost model prices cheapest there.

    Args:
        comm: this rank's communicator.
        buf: the buffer to all-reduce.

    Returns:
        The algorithm to run; every rank gets the same for the same buffer.
    """
    key = backend_key(comm)
    if getattr(comm, "simulated", False) and not any(f.backend == key for f in current().fits):
        return choose_on(comm.topology, comm.world_size, int(buf.nbytes), int(buf.itemsize))
    return choose(key, comm.world_size, int(buf.nbytes), int(buf.itemsize),
                  node_key(getattr(comm, "hosts", None)))


@lru_cache(maxsize=4096)
def choose_on(topology: Topology, world_size: int, nbytes: int, itemsize: int = 4) -> str:
    """The registered all-reduce that the cost model prices cheapest on ``topology`` (ties: registry
    order); a schedule that cannot be built at this world size is no candidate.

    Args:
        topology: the machine to price on.
        world_size: the number of ranks.
        nbytes: the buffer's bytes.
        itemsize: bytes per element.

    Returns:
        The algorithm ("ring" when none can be built).
    """
    from dplab.reference.costmodel import region_algorithms

    best: tuple[float, str] | None = None
    for alg in region_algorithms(topology):
        try:
            t = _walk(allreduce_schedule(alg, world_size), nbytes, itemsize, topology)
        except DplabError:
            continue
        if best is None or t < best[0]:
            best = (t, alg)
    return "ring" if best is None else best[1]


def reset() -> None:
    """Forget the fit and the cached choices (after writing a new fit, or changing $DPLAB_TUNE)."""
    current.cache_clear()
    choose.cache_clear()
    choose_on.cache_clear()
