"""Worlds that ``launch`` starts keep gloo's sockets on loopback; a user's GLOO_SOCKET_IFNAME wins.

Left alone, gloo binds its data sockets to whatever the host name resolves to. Here the host
name resolves to 127.0.0.1, so the decisive test runs ``launch`` in a UTS namespace whose host
name is this machine's public address (``unshare -u``, root only; it skips elsewhere, saying
why). A rank reads its own TCP sockets: the inodes behind /proc/self/fd joined with
/proc/self/net/tcp{,6}.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from dplab.backends.launch.world import launch
from dplab.backends.torchdist.setup import available

if available():
    pytest.skip(f"torch backend unavailable: {available()}", allow_module_level=True)

pytestmark = pytest.mark.torch


def bound_addresses() -> list[str]:
    """The local addresses of this process's TCP sockets (listening and connected)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    out.append(_address(fields[1].split(":")[0], width))
    return sorted(out)


def _address(hex_ip: str, width: int) -> str:
    raw = bytes.fromhex(hex_ip)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four little-endian words
    # IPv4 on a dual-stack socket
    return socket.inet_ntop(socket.AF_INET6, words).removeprefix("::ffff:")


def _sockets(comm) -> list[str]:
    comm.barrier()  # gloo's full mesh is connected by now
    return bound_addresses()


def public_interface() -> tuple[str, str] | None:
    """(name, IPv4 address) of an interface other than loopback, or None."""
    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return name, address
    return None


def test_a_launched_worlds_sockets_are_on_loopback():
    for rank, addresses in enumerate(launch(_sockets, 2, backend="torch")):
        assert addresses, f"rank {rank} has no TCP socket"
        assert set(addresses) == {"127.0.0.1"}, f"rank {rank}: {addresses}"


@pytest.mark.slow  # slow: a fresh interpreter, torch and gloo ranks (6 CPU-s); loopback: above
def test_loopback_even_when_the_host_name_resolves_to_a_public_address(tmp_path):
    public = public_interface()
    if public is None or shutil.which("unshare") is None:
        pytest.skip("needs a non-loopback IPv4 interface and unshare(1)")
    probe = subprocess.run(["unshare", "-u", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here: {probe.stderr.decode().strip()}")
    script = ("import json, sys; from dplab.backends.launch.world import launch; "
              "from test_torch_loopback import _sockets; "
              "print(json.dumps(launch(_sockets, 2, backend='torch')))")
    env = {
        k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    }
    env["PYTHONPATH"] = os.path.dirname(__file__)
    done = subprocess.run(
        [
            "unshare",
            "-u",
            "sh",
            "-c",
            f'hostname {public[1]} && exec "$0" -c "$1"',
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank, addresses in enumerate(json.loads(done.stdout.strip().splitlines()[-1])):
        assert set(addresses) == {"127.0.0.1"}, (
            f"rank {rank} under host name {public[1]}: {addresses}"
        )


def test_a_users_gloo_socket_ifname_is_left_alone(monkeypatch):
    public = public_interface()
    if public is None:
        pytest.skip("needs a non-loopback IPv4 interface")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", public[0])
    for rank, addresses in enumerate(launch(_sockets, 2, backend="torch")):
        # gloo's; the store stays on loopback
        assert public[1] in addresses, f"rank {rank}: {addresses}"
