"""The two-level cost model on a real slow link: measure, fit with dplab tune, compare (root only).

    python -m dplab.backends.bench.two_level --rate 1gbit --reps 5 --tune-reps 5 \
        --out backends/bench/two_level_1gbit.json
    python -m dplab.backends.bench.two_level control --sizes 1M,4M --reps 3 \
        --out backends/bench/two_level_1gbit.json       # adds: the same with no rate limit

Two namespace hosts (``netns``) of g ranks, shared memory within a host and TCP through a ``tbf``
limited to ``--rate`` between them, on two networks (``PORTS``): ``rank``, a link per rank (the
model's one NIC per GPU), and ``host``, one link per host. It fits the inter-host link on 2 x 1
ranks and the intra-host link on 1 x g (both hosts at once), then times flat ring, Rabenseifner
and ``hierarchical:g`` on 2 x g at every size (fastest repetition of the slowest rank). The JSON
file holds the measurements with command, machine and load, the fits with their bench rows, and
``costmodel.cost``'s prediction per cell; ``model(data, cell)`` re-prices a cell, as the tests
do; ``measure`` runs one measurement in a cluster of its own. Results: backends/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from dplab.backends.hosts.netns import IFACE, MPI_ENV, Cluster, ClusterError

__all__ = ["ALGORITHMS", "PORTS", "topology", "model", "algorithm_name", "measure", "measure_rank",
           "run", "main"]

# hierarchical runs as hierarchical:<ranks per host>
ALGORITHMS = ("ring", "rabenseifner", "hierarchical")
# the sizes the comparison is about: the fit is not bent by 64 KiB's costs
TUNE_SIZES = "1M,4M,16M,64M"
PORTS = {"host": "one link per host, its ranks share it (a server with one NIC)",
         "rank": "one link per rank (each GPU of a DGX has its own NIC): what the two-level "
                 "model assumes"}
STEP_TIMEOUT_S = 600


def algorithm_name(algorithm: str, ranks_per_host: int) -> str:
    """The schedule a cell ran: ``hierarchical`` takes the layout's node size."""
    return f"hierarchical:{ranks_per_host}" if algorithm == "hierarchical" else algorithm


def topology(data: dict[str, Any], ranks_per_host: int) -> Any:
    """The two-level topology the file's fits describe for ``ranks_per_host`` ranks on each host."""
    from dplab.reference.topology import Link, Topology

    inter = data["fits"]["inter"]
    intra = data["fits"]["intra"][str(ranks_per_host)]
    return Topology(f"netns-{data['meta']['rate']}", ranks_per_host,
                    Link(intra["alpha_s"], intra["beta_s_per_byte"]),
                    Link(inter["alpha_s"], inter["beta_s_per_byte"]), 0.0,
                    "dplab tune on this cluster: gamma folded into each link's beta")


def model(data: dict[str, Any], cell: dict[str, Any], topo: Any = None) -> float:
    """Seconds the two-level cost model gives for one measured cell of the file (on ``topo``, by
    default the file's own ``topology``)."""
    from dplab.reference.algorithms import allreduce_schedule
    from dplab.reference.costmodel import cost

    g, p = cell["ranks_per_host"], cell["hosts"] * cell["ranks_per_host"]
    schedule = allreduce_schedule(algorithm_name(cell["algorithm"], g), p)
    return cost(schedule, cell["bytes"], itemsize=4, topology=topo or topology(data, g)).time


# -- on every rank, under mpiexec ------------------------------------------------------------------

def measure_rank(comm: Any, algorithms: list[str], sizes: list[int],
                 reps: int) -> dict[str, list[float]]:
    """This rank's seconds per repetition for every (algorithm, size): one all-reduce after a
    barrier, algorithms interleaved, after one warm-up call each
    (connections made, pages touched)."""
    from dplab.reference.collectives import allreduce

    out: dict[str, list[float]] = {}
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, np.float32)
        for a in algorithms:
            allreduce(comm, buf, a)
        for _ in range(reps):
            for a in algorithms:
                comm.barrier()
                t0 = time.perf_counter()
                allreduce(comm, buf, a)
                out.setdefault(f"{a} {nbytes}", []).append(time.perf_counter() - t0)
    return out


def _rank_main(a: argparse.Namespace) -> int:
    from dplab.backends.launch.engine import LauncherWorld

    with LauncherWorld("mpi", timeout=120.0) as world:
        per_rank = world.run(measure_rank, a.algorithms.split(","),
                             [int(s) for s in a.sizes.split(",")], a.reps)
        if world.comm.rank == 0:
            Path(a.out).write_text(json.dumps(per_rank))
    return 0


# -- the driver, outside the cluster ---------------------------------------------------------------

# Each rank of a hydra proxy (one proxy per host) enters the namespace its host and local rank name:
# ranks of one proxy still share memory (MPICH's shm: one node to hydra, one /dev/shm), but each
# has its own link to the bridge, as each GPU of a DGX has its own NIC.
_ENTER_RANK = """#!/bin/sh
case "$(ip netns identify $$):$MPI_LOCALRANKID" in
{cases}
  *) echo "$0: no namespace for $(ip netns identify $$) local rank $MPI_LOCALRANKID" >&2; exit 1;;
esac
exec ip netns exec "$ns" "$@"
"""


class _Hosts:
    """2 hosts of up to ``g_max`` ranks over one cluster of ``2 g_max`` namespaces, each its own
    link.

    Host h is namespaces h g_max .. h g_max + g_max - 1; its hydra proxy runs in the first. With
    ``ports="host"`` every rank stays in the proxy's namespace (one link per host, shared by its
    ranks); with ``ports="rank"`` local rank i enters namespace h g_max + i (one link per rank)."""

    def __init__(self, c: Cluster, g_max: int, tmp: Path) -> None:
        self.c, self.g_max = c, g_max
        self.enter_rank = tmp / "enter-rank"
        cases = "\n".join(f"  {c.namespaces[h * g_max]}:{i}) ns={c.namespaces[h * g_max + i]};;"
                          for h in range(2) for i in range(g_max))
        self.enter_rank.write_text(_ENTER_RANK.format(cases=cases))
        self.enter_rank.chmod(0o755)

    def mpiexec(self, hosts: list[int], per_host: int, ports: str, argv: list[str]) -> None:
        """``mpiexec`` from host 0's proxy namespace, ``per_host`` ranks on each of ``hosts``."""
        c = self.c
        spec = ",".join(f"{c.addrs[h * self.g_max]}:{per_host}" for h in hosts)
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        wrap = [str(self.enter_rank)] if ports == "rank" else []
        cmd = [mpiexec, "-launcher", "ssh", "-launcher-exec", c.enter_script, "-iface", IFACE,
               "-hosts", spec, "-n", str(per_host * len(hosts)), *wrap, *argv]
        done = c.run(0, cmd, STEP_TIMEOUT_S, env=_env(), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise ClusterError(f"{shlex.join(cmd)} exited "
                               f"{done.returncode}:\n{done.stderr[-3000:]}")

    def link_bytes(self) -> int:
        """Bytes sent over every link of the cluster so far (the bridge ends of the veths)."""
        return sum(
            int(Path(f"/sys/class/net/{v}/statistics/rx_bytes").read_text()) for v in self.c.veths
        )


def _env() -> dict[str, str]:
    """This environment without any launcher's variables, plus MPICH's ofi/tcp between hosts."""
    drop = ("PMI_", "DPLAB_", "OMPI_", "PMIX_", "MPI_LOCAL", "FI_", "UCX_", "MPIR_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return env | {"OMP_NUM_THREADS": "1"} | MPI_ENV


def _tune(h: _Hosts, hosts: list[int], per_host: int, reps: int, tmp: Path, tag: str,
          apart: bool = False) -> dict[str, Any]:
    """``dplab bench`` of the ring on these ranks, then ``dplab tune --from-json`` of its rows (ring
    only: gamma folded); the backend-wide fit, the rows and both commands. ``apart``: one bench
    per host, all at once (each host's ranks among themselves), as hierarchical's intra-host
    rounds run: here the hosts share this machine's cores, so a host alone would be faster."""
    dplab = str(Path(sys.executable).parent / "dplab")
    fit_path = tmp / f"tune-{tag}.json"
    groups = [[x] for x in hosts] if apart else [hosts]
    p = str(per_host * len(groups[0]))
    bench = ["bench", "--backends", "mpi", "--world-sizes", p, "--algorithms", "ring", "--sizes",
             TUNE_SIZES, "--reps", str(reps), "--target-seconds", "0.3"]
    paths = [tmp / f"bench-{tag}-{i}.json" for i in range(len(groups))]
    before = h.link_bytes()
    with ThreadPoolExecutor(len(groups)) as pool:  # result(): a failed bench raises here
        for f in [pool.submit(h.mpiexec, group, per_host, "rank",
                              [dplab, *bench, "--json", str(out)])
                  for group, out in zip(groups, paths)]:
            f.result()
    crossed = h.link_bytes() - before
    rows = [{k: r[k] for k in ("backend", "algorithm", "world_size", "bytes", "time_us")}
            for path in paths
            for r in json.loads(path.read_text())["rows"] if r["algorithm"] == "ring"]
    rows_path = tmp / f"rows-{tag}.json"
    rows_path.write_text(json.dumps({"rows": rows}))
    tune = ["tune", "--from-json", str(rows_path), "--out", str(fit_path)]
    done = subprocess.run([dplab, *tune], capture_output=True, text=True, env=_env())
    if done.returncode != 0:
        raise ClusterError(f"dplab tune: {done.stderr[-2000:]}")
    fit = next(f for f in json.loads(fit_path.read_text())["fits"]
               if (f["world_size"], f["algorithm"]) == ("all", "all"))
    bench_cmd = shlex.join(["dplab", *bench, "--json", "rows.json"])
    runs = [f"mpiexec -hosts {','.join(f'h{x}:{per_host}' for x in group)} -n {p} {bench_cmd}"
            for group in groups]
    return {"commands": [" & ".join(runs), "dplab tune --from-json rows.json --out tune.json"],
            "alpha_s": fit["alpha_s"], "beta_s_per_byte": fit["beta_s_per_byte"],
            "note": fit["note"], "link_bytes": crossed, "rows": rows}


def _cells(h: _Hosts, port: str, g: int, algorithms: Sequence[str], sizes: list[int], reps: int,
           tmp: Path) -> list[dict[str, Any]]:
    """One measurement on 2 hosts x ``g`` ranks: a cell per algorithm and size."""
    names = [algorithm_name(a, g) for a in algorithms]
    out = tmp / f"measure-{port}-{g}.json"
    h.mpiexec([0, 1], g, port, [sys.executable, "-m", "dplab.backends.bench.two_level", "rank",
                                "--algorithms", ",".join(names), "--sizes",
                                ",".join(map(str, sizes)), "--reps", str(reps), "--out", str(out)])
    per_rank = json.loads(out.read_text())
    cells = []
    for a, name in zip(algorithms, names):
        for nbytes in sizes:
            slowest = np.max([r[f"{name} {nbytes}"] for r in per_rank], axis=0)
            cells.append({"ports": port, "hosts": 2, "ranks_per_host": g, "algorithm": a,
                          "bytes": nbytes, "reps_s": [float(t) for t in slowest],
                          "measured_s": float(slowest.min())})
    return cells


def measure(rate: str, ports: str, ranks_per_host: int, sizes: list[int], reps: int,
            algorithms: Sequence[str] = ALGORITHMS) -> list[dict[str, Any]]:
    """A cluster of its own, one measurement in it (no fit): the cells, as in the file."""
    with Cluster(hosts=2 * ranks_per_host, ranks_per_host=1, rate=rate) as c, \
            tempfile.TemporaryDirectory(prefix="dplab-two-level-") as d:
        return _cells(_Hosts(c, ranks_per_host, Path(d)), ports, ranks_per_host, algorithms, sizes,
                      reps, Path(d))


def _machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    mpich = subprocess.run([str(Path(sys.executable).parent / "mpichversion"), "--version"],
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "mpich": mpich, "commit": commit}


def run(rate: str, layouts: list[int], sizes: list[int], reps: int, tune_reps: int,
        ports: list[str]) -> dict[str, Any]:
    """Everything above in one cluster; returns the file's contents."""
    load = [os.getloadavg()]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cells: list[dict[str, Any]] = []
    fits: dict[str, Any] = {"inter": None, "intra": {}}
    g_max = max(layouts)
    with Cluster(hosts=2 * g_max, ranks_per_host=1, rate=rate) as c, \
            tempfile.TemporaryDirectory(prefix="dplab-two-level-") as d:
        tmp = Path(d)
        h = _Hosts(c, g_max, tmp)
        fits["inter"] = _tune(h, [0, 1], 1, tune_reps, tmp, "inter")
        for g in layouts:
            fits["intra"][str(g)] = _tune(h, [0, 1], g, tune_reps, tmp, f"intra{g}", apart=True)
        load.append(os.getloadavg())
        for port in ports:
            for g in layouts:
                cells += _cells(h, port, g, ALGORITHMS, sizes, reps, tmp)
                load.append(os.getloadavg())
    command = shlex.join(["python", "-m", "dplab.backends.bench.two_level", *sys.argv[1:]])
    data = {"meta": {"command": command,
                     "started": started, "rate": rate, "tbf_burst_bytes": _burst_of(rate),
                     "backend": "mpi",
                     "transport": "MPICH ch4 ofi/tcp between hosts, shm inside a host",
                     "dtype": "float32", "reps": reps, "ports": PORTS,
                     "statistic": "fastest repetition of the slowest rank's time after a barrier",
                     "loadavg_1_5_15": [[round(x, 2) for x in row] for row in load],
                     "machine": _machine()},
            "fits": fits, "cells": cells}
    for cell in cells:
        cell["model_s"] = model(data, cell)
    return data


def _burst_of(rate: str) -> int:
    from dplab.backends.hosts.netns import _burst

    return _burst(rate)


def control(data: dict[str, Any], sizes: list[int], reps: int) -> dict[str, Any]:
    """Ring and hierarchical at ``sizes`` on a link per rank, with the file's rate and with no rate
    limit at all, back to back, for each layout: where both take as long, the link is not what
    the time is made of."""
    load = [os.getloadavg()]
    cells = []
    for g in sorted({c["ranks_per_host"] for c in data["cells"]}):
        for rate in (data["meta"]["rate"], None):
            for c in measure(rate, "rank", g, sizes, reps, ("ring", "hierarchical")):
                cells.append(c | {"rate": rate})
        load.append(os.getloadavg())
    command = shlex.join(["python", "-m", "dplab.backends.bench.two_level", *sys.argv[1:]])
    return {"command": command, "reps": reps,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "loadavg_1_5_15": [[round(x, 2) for x in row] for row in load], "cells": cells}


def parse_size(text: str) -> int:
    """'64K', '16M', '1G' or a plain byte count."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    return int(float(t[:-1]) * units[t[-1]]) if t[-1:] in units else int(t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dplab.backends.bench.two_level",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part")
    r = sub.add_parser("rank", help="(internal) one rank of the measurement, under mpiexec")
    k = sub.add_parser("control",
                       help="add to --out's file: ring and hierarchical at small sizes with "
                                       "its rate and with none")
    k.add_argument("--out", required=True)
    for q in (p, r, k):
        q.add_argument("--sizes", default="1M,4M,16M,64M")
        q.add_argument("--reps", type=int, default=3)
    r.add_argument("--algorithms", required=True)
    r.add_argument("--out", required=True)
    p.add_argument("--rate", default="1gbit", help="each host's link, as tc writes it")
    p.add_argument("--layouts", default="2,4", help="ranks per host, one run of 2 hosts each")
    p.add_argument("--tune-reps", type=int, default=3)
    p.add_argument("--ports", default="rank,host",
                   help="rank: a link per rank; host: one per host, shared")
    p.add_argument("--out", help="the JSON file to write")
    a = p.parse_args(argv)
    if a.part is None and not a.out:
        p.error("give --out PATH")
    if a.part == "rank":
        a.sizes = ",".join(str(parse_size(s)) for s in a.sizes.split(","))
        return _rank_main(a)
    if a.part == "control":
        data = json.loads(Path(a.out).read_text())
        data["control"] = control(data, [parse_size(s) for s in a.sizes.split(",")], a.reps)
        Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
        for c in data["control"]["cells"]:
            print(f"2x{c['ranks_per_host']} {c['algorithm']:13s} {c['bytes'] >> 20:3d} MiB  "
                  f"rate {c['rate']}: "
                  f"{c['measured_s'] * 1e3:8.1f} ms")
        return 0
    data = run(a.rate, [int(g) for g in a.layouts.split(",")],
               [parse_size(s) for s in a.sizes.split(",")], a.reps, a.tune_reps, a.ports.split(","))
    Path(a.out).write_text(json.dumps(data, indent=1) + "\n")
    for cell in data["cells"]:
        print(f"{cell['ports']:4s} 2x{cell['ranks_per_host']} {cell['algorithm']:13s} "
              f"{cell['bytes'] >> 20:3d} MiB  "
              f"measured {cell['measured_s'] * 1e3:8.1f} ms  model {cell['model_s'] * 1e3:8.1f} "
              f"ms  {cell['model_s'] / cell['measured_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
