"""Several hosts on one machine: a namespace per host on a bridge, for multi-host runs (root only).

    with Cluster(hosts=2, ranks_per_host=2, rate="1gbit") as cluster:
        cluster.addrs                                # ['10.213.0.1', '10.213.0.2']
        cluster.popen(1, ["torchrun", ...])          # runs inside host 1's namespace
    # gone: every process in the namespaces, the namespaces, veths, bridge and the temp folder

    python -m dplab.backends.hosts.netns --hosts 2 --rate 1gbit   # up until Ctrl-C (prints usage)

Host i is a namespace with ``lo`` and ``IFACE`` at ``10.213.0.<i+1>/24``, its peer end on a bridge
with no address and no route out: nothing leaves the machine, and clusters side by side may share
the subnet. ``rate`` puts a ``tbf`` on both ends of every host's link. Leaving the ``with`` block
(also by an exception or Ctrl-C) removes everything, signals held meanwhile; a guard process does
it within a second if the owner is SIGKILLed, and ``sweep_stale`` in the next ``Cluster`` removes
what survived. ``enter_script`` lets MPICH's hydra reach a host: ``mpiexec -launcher ssh
-launcher-exec <it> -hosts 10.213.0.1:2,10.213.0.2:2``.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from dplab.backends.launch.interrupt import signals_deferred
from dplab.backends.local.shm import process_alive

__all__ = ["Cluster", "ClusterError", "IFACE", "TORCH_ENV", "MPI_ENV", "available", "sweep_stale",
           "leftovers", "main"]

IFACE = "dpl0"  # every host's link has this name inside its namespace: GLOO_SOCKET_IFNAME, -iface
SUBNET = "10.213.0.0/24"
# namespaces: pid, serial, host; available()'s
_NS = re.compile(r"^dplab-(\d+)-(?:(\d+)-h\d+|probe)$")
# bridge and veths (15 characters at most)
_LINK = re.compile(r"^dp([0-9a-f]+)\.([0-9a-f]+)[bv]\d*$")
_serial = itertools.count()
# gloo's sockets on the cluster's interface (in a namespace the hostname names no address of it)
TORCH_ENV = {"GLOO_SOCKET_IFNAME": IFACE}
# MPICH's ch4 over TCP between hosts. The wheel's default netmod, UCX, takes every namespace for one
# machine (same hostname and boot id) and moves their bytes through shared memory, past the link.
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

# hydra runs "<launcher-exec> [options] HOST COMMAND..."
# as it would ssh; this enters HOST's namespace.
_ENTER = """#!/bin/sh
# MPICH hydra's -launcher-exec for a dplab namespace cluster: <this> [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "$0: $host is not a host of this cluster" >&2; exit 255;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""


# The guard: a process of its own that removes the cluster if its owner dies
# without a word (SIGKILL, the OOM killer). It imports nothing of dplab (that
# costs a second of numpy) and polls the owner's pid and start time, so a
# recycled pid does not fool it. argv: owner pid, start, dir, bridge, ns...
_GUARD = """
import os, shutil, signal, subprocess, sys, time
pid, start, folder, bridge, *spaces = sys.argv[1:]
def started():
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
while started() == start:
    time.sleep(0.2)
def ip(*a):
    return subprocess.run(["ip", *a], capture_output=True, text=True).stdout
for sig in (signal.SIGTERM, signal.SIGKILL):
    for p in {int(p) for ns in spaces for p in ip("netns", "pids", ns).split()}:
        try:
            os.kill(p, sig)
        except OSError:
            pass
    time.sleep(0.5)
for i, ns in enumerate(spaces):
    ip("link", "delete", bridge[:-1] + f"v{i}")
    ip("netns", "delete", ns)
ip("link", "delete", bridge)
shutil.rmtree(folder, ignore_errors=True)
"""


class ClusterError(RuntimeError):
    """The cluster could not be made (not root, no iproute2, a command failed): says which."""


@functools.cache
def available() -> str | None:
    """None when namespaces can be made here, else why not (for a test's skip reason).

    Returns:
        None, or the reason in a few words.
    """
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridge)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"dplab-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _ip("-o", "link", "show").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def leftovers(pid: int | None = None) -> list[str]:
    """Every dplab namespace, link and temp folder that exists (of ``pid``'s clusters, if given).

    Args:
        pid: the owner process whose clusters to list; None: every owner's.

    Returns:
        Their names (namespaces, links, folders).
    """
    mine = (lambda owner: True) if pid is None else (lambda owner: owner == pid)
    found = [f"netns {n}" for n in _namespaces() if (m := _NS.match(n)) and mine(int(m[1]))]
    found += [f"link {n}" for n in _links() if (m := _LINK.match(n)) and mine(int(m[1], 16))]
    found += [f"dir {p}" for p in Path(tempfile.gettempdir()).glob("dplab-netns-*")
              if (m := re.match(r"dplab-netns-(\d+)-", p.name)) and mine(int(m[1]))]
    # processes left in a namespace keep it from being
    # freed, but they are gone with it from `ip netns`
    return found


def sweep_stale() -> list[str]:
    """Remove the clusters whose owner process is gone (it was SIGKILLed); returns what went.

    Returns:
        The names of what was removed.
    """
    owners = {int(m[1]) for n in _namespaces() if (m := _NS.match(n))}
    owners |= {int(m[1], 16) for n in _links() if (m := _LINK.match(n))}
    owners |= {int(m[1]) for p in Path(tempfile.gettempdir()).glob("dplab-netns-*")
               if (m := re.match(r"dplab-netns-(\d+)-", p.name))}
    gone = []
    for pid in sorted(owners):
        if not process_alive(pid):
            gone += leftovers(pid)
            _remove(pid, None)
    return gone


def _kill_in(namespaces: Sequence[str], grace: float) -> None:
    """SIGTERM every process in the namespaces, SIGKILL what is left after ``grace`` seconds."""
    def pids() -> set[int]:
        return {int(p) for ns in namespaces
                for p in _ip("netns", "pids", ns, check=False).stdout.split()}

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        left = pids() - {os.getpid()}
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.02)
            left = pids() - {os.getpid()}
        if not left:
            return


def _remove(pid: int, serial: int | None) -> None:
    """Delete what clusters of ``pid`` (one ``serial``, or all) made:
    processes first, then links."""
    def ours(owner: int, ser: int) -> bool:
        return owner == pid and (serial is None or ser == serial)

    namespaces = [n for n in _namespaces()
                  if (m := _NS.match(n)) and ours(int(m[1]), int(m[2] or -1))]
    _kill_in(namespaces, grace=1.0)
    links = [n for n in _links() if (m := _LINK.match(n)) and ours(int(m[1], 16), int(m[2], 16))]
    # veths (both ends at once), then bridge
    for link in sorted(links, key=lambda n: n.endswith("b")):
        _ip("link", "delete", link, check=False)
    for ns in namespaces:
        _ip("netns", "delete", ns, check=False)
    for path in Path(tempfile.gettempdir()).glob(f"dplab-netns-{pid}-*"):
        m = re.match(r"dplab-netns-\d+-(\d+)-", path.name)
        if m and (serial is None or int(m[1]) == serial):
            shutil.rmtree(path, ignore_errors=True)


def _burst(rate: str) -> int:
    """tbf's bucket in bytes: 4 ms of the rate (a kernel tick at HZ=250), at
    least 64 KiB (one GSO packet)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ClusterError(f"rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")
    bits = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
    return max(int(bits / 8 * 0.004), 65536)


class Cluster:
    """``hosts`` namespaces on a bridge, ``ranks_per_host`` ranks meant for each (a context
    manager).

    Args:
        hosts: namespaces, 1..64, each with its own address in ``subnet``.
        ranks_per_host: the ranks each host is meant to run (``mpi_hosts``, ``torchrun_args``).
        rate: each host's link rate-limited to this (``tbf``, e.g. ``"1gbit"``); None: no limit.
        subnet: the bridge's private network.

    Raises:
        ClusterError: ``hosts`` or ``ranks_per_host`` out of range, or a rate ``tc`` cannot read.
    """

    def __init__(self, hosts: int = 2, ranks_per_host: int = 2, rate: str | None = None,
                 subnet: str = SUBNET) -> None:
        net = ipaddress.ip_network(subnet)
        if not 1 <= hosts <= min(64, net.num_addresses - 2):
            raise ClusterError(f"hosts must be 1..64 and fit {subnet}, got {hosts}")
        if ranks_per_host < 1:
            raise ClusterError(f"ranks_per_host must be at least 1, got {ranks_per_host}")
        if rate is not None:
            _burst(rate)
        self.hosts, self.ranks_per_host = hosts, ranks_per_host
        self.rate, self.prefix = rate, net.prefixlen
        self.pid, self.serial = os.getpid(), next(_serial)
        tag = f"dp{self.pid:x}.{self.serial:x}"
        self.bridge = f"{tag}b"
        self.veths = [f"{tag}v{i}" for i in range(hosts)]
        self.namespaces = [f"dplab-{self.pid}-{self.serial}-h{i}" for i in range(hosts)]
        self.addrs = [str(net.network_address + i + 1) for i in range(hosts)]
        self.dir: Path | None = None
        self._procs: list[subprocess.Popen] = []
        self._guard: subprocess.Popen | None = None

    # -- up and down -------------------------------------------------------------------------
    def up(self) -> Cluster:
        """Make the bridge, namespaces, links and the enter script; on any failure remove them
        again.

        Returns:
            This cluster, up.

        Raises:
            ClusterError: namespaces cannot be made here (not root, no iproute2), or a command
                failed; saying which.
        """
        if (why := available()) is not None:
            raise ClusterError(why)
        sweep_stale()
        try:
            with signals_deferred():  # a Ctrl-C now waits: then ``down`` finds whole objects
                self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"dplab-netns-{self.pid}-{self.serial}-"))
        start = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        self._guard = subprocess.Popen(  # its own session: a Ctrl-C to our terminal leaves it to us
            [sys.executable, "-c", _GUARD, str(self.pid), start, str(self.dir), self.bridge,
             *self.namespaces], stdin=subprocess.DEVNULL, start_new_session=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addrs):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFACE, "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{self.prefix}", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                tbf = ["root", "tbf", "rate", self.rate, "burst", str(_burst(self.rate)), "latency",
                       "100ms"]
                for where in (["tc", "qdisc", "add", "dev", veth],
                              ["tc", "-n", ns, "qdisc", "add", "dev", IFACE]):
                    done = subprocess.run([*where, *tbf], capture_output=True, text=True)
                    if done.returncode != 0:
                        raise ClusterError(f"{' '.join(where + tbf)}: {done.stderr.strip()}")
        cases = "\n".join(f"  {a}|h{i}) ns={ns};;" for i, (a, ns)
                          in enumerate(zip(self.addrs, self.namespaces)))
        enter = self.dir / "enter"
        enter.write_text(_ENTER.format(cases=cases))
        enter.chmod(0o755)
        self._wait_links()

    def _wait_links(self) -> None:
        """Until every host answers ARP for its peers: the first connect then needs no retry."""
        deadline = time.monotonic() + 5
        for ns in self.namespaces:
            while "state UP" not in _ip("-n", ns, "link", "show", IFACE).stdout:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{ns}: {IFACE} did not come up")
                time.sleep(0.01)

    def down(self) -> None:
        """Kill every process in the namespaces, delete links, namespaces, bridge, temp folder."""
        with signals_deferred():
            for proc in self._procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            _remove(self.pid, self.serial)
            if self._guard is not None:  # the cluster is gone: nothing left to guard
                self._guard.kill()
                self._guard.wait()
                self._guard = None
            for proc in self._procs:
                try:
                    proc.wait(2)
                except subprocess.TimeoutExpired:
                    pass
            self._procs.clear()

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- using it -----------------------------------------------------------------------------
    @property
    def enter_script(self) -> str:
        """hydra's ``-launcher-exec``: runs a command on a host named by
        its address (or h0, h1, ...)."""
        assert self.dir is not None, "the cluster is not up"
        return str(self.dir / "enter")

    def mpi_hosts(self) -> str:
        """``-hosts`` for mpiexec: every address with its ranks, ``10.213.0.1:2,10.213.0.2:2``.

        Returns:
            The ``-hosts`` value.
        """
        return ",".join(f"{a}:{self.ranks_per_host}" for a in self.addrs)

    def mpiexec_args(self) -> list[str]:
        """mpiexec's flags for a job over every host (run it in host 0, with ``MPI_ENV``): hydra
        reaches a host through ``enter_script`` and listens on ``IFACE``'s address (the hostname
        names no address in the namespaces), the ranks as ``-hosts`` places them.

        Returns:
            mpiexec's arguments before the program.
        """
        return ["-launcher", "ssh", "-launcher-exec", self.enter_script, "-iface", IFACE,
                "-hosts", self.mpi_hosts(), "-n", str(self.hosts * self.ranks_per_host)]

    def torchrun_args(self, host: int, rdzv_id: str, port: int = 29500) -> list[str]:
        """torchrun's flags for host ``host``'s launcher (one per host, with ``TORCH_ENV``): c10d
        rendezvous on host 0. Every namespace has this machine's hostname, so each launcher gives
        its address (``--local-addr``: else the workers' MASTER_ADDR is "localhost") and host 0 is
        told it serves the store (``is_host``: torch cannot tell from an address of a second
        interface).

        Args:
            host: the host whose launcher these flags are for.
            rdzv_id: the job's rendezvous id, the same on every host.
            port: host 0's store port.

        Returns:
            torchrun's arguments before the program.
        """
        return ["--nnodes", str(self.hosts), "--nproc-per-node", str(self.ranks_per_host),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addrs[0]}:{port}", "--rdzv-id",
                rdzv_id,
                "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", self.addrs[host]]

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace.

        Args:
            host: the host's index.
            argv: the command.

        Returns:
            The command line that runs it there (``ip netns exec``).
        """
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` in host ``host`` (its own process group); ``down`` kills it if still
        running.

        Args:
            host: the host's index.
            argv: the command.
            **kwargs: passed to ``subprocess.Popen``.

        Returns:
            The started process.
        """
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True,
                                **kwargs)  # type: ignore[arg-type]
        self._procs.append(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], timeout: float,
            **kwargs: object) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` in host ``host``, killed with its group after
        ``timeout``.

        Args:
            host: the host's index.
            argv: the command.
            timeout: seconds it may take.
            **kwargs: passed to ``subprocess.Popen`` (``stdout=subprocess.PIPE``, ...).

        Returns:
            The finished process, with its output.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (its group is killed first).
        """
        proc = self.popen(host, argv, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _usage(c: Cluster) -> str:
    def env(values: dict[str, str]) -> str:
        return " ".join(f"{k}={v}" for k, v in values.items())

    torch = "\n".join(f"  {shlex.join(c.command(i, ['env', *env(TORCH_ENV).split(), 'torchrun']))} "
                      f"{shlex.join(c.torchrun_args(i, 'demo'))} -m dplab.backends.cli train "
                      "--backend torch"
                      for i in range(c.hosts))
    mpi = (f"  {shlex.join(c.command(0, ['env', *env(MPI_ENV).split(), 'mpiexec']))} "
           f"{shlex.join(c.mpiexec_args())} dplab train --backend mpi")
    limited = f", links limited to {c.rate}" if c.rate else ""
    return (f"cluster up: {c.hosts} hosts x {c.ranks_per_host} ranks, {', '.join(c.addrs)} "
            f"on {IFACE}{limited}; "
            f"namespaces {' '.join(c.namespaces)}\n"
            f"torchrun, one launcher per host (each in its own terminal):\n{torch}\n"
            f"mpiexec, from host 0:\n{mpi}\n"
            "Ctrl-C here takes it all down (processes in the namespaces included).")


def main(argv: list[str] | None = None) -> int:
    """The by-hand script: bring a cluster up, print how to use it, keep it until Ctrl-C or SIGTERM;
    with ``-- COMMAND`` run that instead (in this namespace, with $DPLAB_NETNS_* set) and take it
    down.

    Args:
        argv: the command line (None: ``sys.argv[1:]``).

    Returns:
        The exit code: the command's; 128 + the signal that took the cluster down; 2 when it
        could not be made; 0 after ``--sweep``.
    """
    p = argparse.ArgumentParser(prog="python -m dplab.backends.hosts.netns",
                                description=main.__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", help="limit each host's link, as tc writes it: 1gbit, 100mbit")
    p.add_argument("--sweep", action="store_true", help="only remove clusters whose owner died")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: run this with the cluster up (in this namespace, with "
                        "$DPLAB_NETNS_ADDRS, _NAMESPACES, _ENTER, _HOSTS, _IFACE set), then take "
                        "it down; its exit code")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.sweep:
        for what in sweep_stale():
            print(f"removed {what}")
        return 0

    got: list[int] = []

    def stop(signum: int, frame: object) -> None:
        got.append(signum)
        raise KeyboardInterrupt  # leaving the with block is the cleanup

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        with Cluster(a.hosts, a.ranks_per_host, a.rate) as c:
            if command:
                env = dict(os.environ, DPLAB_NETNS_ADDRS=",".join(c.addrs),
                           DPLAB_NETNS_NAMESPACES=",".join(c.namespaces),
                           DPLAB_NETNS_ENTER=c.enter_script,
                           DPLAB_NETNS_HOSTS=c.mpi_hosts(), DPLAB_NETNS_IFACE=IFACE)
                return subprocess.run(command, env=env).returncode
            print(_usage(c), flush=True)
            while True:
                signal.pause()
    except KeyboardInterrupt:
        print("netns: cluster down", file=sys.stderr, flush=True)
        return 128 + (got[0] if got else signal.SIGINT)
    except ClusterError as e:
        print(f"netns: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
