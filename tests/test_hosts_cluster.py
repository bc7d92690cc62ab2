"""The namespace cluster itself (root only): hosts reach each other and nothing else, links can be
slowed, and every exit path (done, an exception, SIGINT, SIGTERM, SIGKILL of its owner) leaves no
namespace, veth, bridge, temp folder or process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import hosts
import pytest
from hosts import hosts_env

from dplab.backends.hosts.netns import Cluster, leftovers

pytestmark = pytest.mark.hosts
cluster = hosts.cluster  # the fixture: 2 hosts x 2 ranks

# In a host: serve N bytes to one client on PORT, or fetch them and print the seconds it took.
SERVE = """
import socket, sys
s = socket.create_server((sys.argv[1], 5000)); print("up", flush=True)
c, _ = s.accept(); c.sendall(bytes(int(sys.argv[2]))); c.close()
"""
FETCH = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5000), timeout=10); t = time.perf_counter(); n = 0
while chunk := c.recv(1 << 16):
    n += len(chunk)
print(n, time.perf_counter() - t)
"""


def _transfer(c: Cluster, nbytes: int) -> float:
    """Seconds host 0 takes to fetch ``nbytes`` from host 1."""
    server = c.popen(
        1, [sys.executable, "-c", SERVE, c.addrs[1], str(nbytes)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline() == "up\n"
    got, seconds = c.run(
        0, [sys.executable, "-c", FETCH, c.addrs[1]], timeout=30, stdout=subprocess.PIPE, text=True
    ).stdout.split()
    server.wait(10)
    assert int(got) == nbytes
    return float(seconds)


def _pids_in(namespaces: list[str]) -> set[int]:
    out = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
           for ns in namespaces]
    return {int(p) for text in out for p in text.split()}


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_hosts_reach_each_other_only(cluster):
    assert cluster.addrs == ["10.213.0.1", "10.213.0.2"] and _transfer(cluster, 1 << 20) >= 0
    for ns in cluster.namespaces:  # no default route: an address outside the cluster is unreachable
        routes = subprocess.run(["ip", "-n", ns, "route"], capture_output=True, text=True).stdout
        assert routes.split() == [
            "10.213.0.0/24",
            "dev",
            "dpl0",
            "proto",
            "kernel",
            "scope",
            "link",
            "src",
            cluster.addrs[cluster.namespaces.index(ns)],
        ]


def test_two_clusters_side_by_side_and_a_slow_link():
    """Same subnet, own bridges: no collision. 1 MiB over 40 Mbit/s takes >= 0.2 s (tbf both
    ways)."""
    hosts.needs_hosts()
    with Cluster(2, 1) as fast, Cluster(2, 1, rate="40mbit") as slow:
        assert not set(fast.namespaces + fast.veths) & set(slow.namespaces + slow.veths)
        quick, limited = _transfer(fast, 1 << 20), _transfer(slow, 1 << 20)
        assert limited >= 0.2 and limited > 3 * quick, (quick, limited)
    assert leftovers(os.getpid()) == []


def test_an_exception_in_the_block_leaves_nothing():
    hosts.needs_hosts()
    with pytest.raises(RuntimeError, match="boom"), Cluster(2, 1) as c:
        # grandchildren: found by namespace
        c.popen(1, ["sh", "-c", "sleep 300 & sleep 300 & wait"])
        deadline = time.monotonic() + 5
        while len(inside := _pids_in(c.namespaces)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        raise RuntimeError("boom")
    assert len(inside) == 3 and all(_gone(p) for p in inside)
    assert leftovers(os.getpid()) == []


def _script(tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dplab.backends.hosts.netns", "--hosts", "2", *args],
        env=hosts_env({}),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _ready(proc: subprocess.Popen, line: str) -> set[int]:
    """Wait for ``line`` on the script's stdout; the pids then in its namespaces."""
    while not (got := proc.stdout.readline()).startswith(line):
        assert got, proc.stderr.read()
    spaces = [f"dplab-{proc.pid}-0-h{i}" for i in range(2)]
    deadline = time.monotonic() + 5
    while True:
        pids = _pids_in(spaces)
        if len(pids) >= 2 or time.monotonic() > deadline:
            return pids
        time.sleep(0.02)


def _left(pid: int, within: float) -> list[str]:
    deadline = time.monotonic() + within
    while (found := leftovers(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_script_stopped_by_a_signal_leaves_nothing(tmp_path, sig):
    """The script's command runs a process in each host; SIGINT (Ctrl-C) or SIGTERM takes it all
    down."""
    hosts.needs_hosts()
    proc = _script(tmp_path, "--", "sh", "-c", 'for ns in $(echo "$DPLAB_NETNS_NAMESPACES" | tr , '
                                               '" "); do '
                   'ip netns exec "$ns" sleep 300 & done; echo ready; wait')
    inside = _ready(proc, "ready")
    proc.send_signal(sig)
    assert proc.wait(20) == 128 + sig
    assert "netns: cluster down" in proc.stderr.read()
    assert len(inside) == 2 and all(_gone(p) for p in inside)
    assert _left(proc.pid, 0) == []


def test_script_prints_the_launch_lines_and_its_guard_cleans_up_after_sigkill(tmp_path):
    """By hand: the script prints the torchrun and mpiexec lines;
    SIGKILLed, its guard removes the rest."""
    hosts.needs_hosts()
    proc = _script(tmp_path)
    _ready(proc, "cluster up: 2 hosts x 2 ranks, 10.213.0.1, 10.213.0.2 on dpl0")
    usage = [proc.stdout.readline() for _ in range(6)]
    assert (
        "--rdzv-backend c10d --rdzv-endpoint 10.213.0.1:29500" in usage[1]
        and "is_host=1" in usage[1]
    )
    assert (
        "--local-addr 10.213.0.2" in usage[2]
        and "-hosts 10.213.0.1:2,10.213.0.2:2 -n 4" in usage[4]
    )
    worker = subprocess.Popen(["ip", "netns", "exec", f"dplab-{proc.pid}-0-h1", "sleep", "300"],
                              start_new_session=True)
    assert leftovers(proc.pid)
    proc.kill()
    proc.wait()
    assert _left(proc.pid, 10) == []
    assert worker.wait(5) == -signal.SIGTERM  # the guard ended what ran in the namespaces
