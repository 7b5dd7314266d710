"""Hosts for multi-host tests: Linux network namespaces joined by a bridge.

Each `Host` is a namespace with loopback up and one veth whose peer sits on a bridge in a
separate "switch" namespace, so the test machine's own network is never touched. Needs
root (or CAP_NET_ADMIN) and iproute2; `NetnsUnavailable` says why they cannot be made.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


@dataclass
class Host:
    netns: str
    address: str

    def wrap(self) -> list[str]:
        """Command prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Network:
    hosts: list[Host] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, count: int) -> Network:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        net = cls()
        tag = uuid.uuid4().hex[:6]
        subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"
        switch = f"orsw{tag}"
        try:
            _ip("netns", "add", switch)
            net._namespaces.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i in range(count):
                ns = f"orh{i}{tag}"
                _ip("netns", "add", ns)
                net._namespaces.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # Created inside the host namespace, its peer then moved to the switch.
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
                _ip("-n", ns, "link", "set", f"p{i}", "netns", switch)
                _ip("-n", switch, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", switch, "link", "set", f"p{i}", "up")
                address = f"{subnet}.{i + 1}"
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                net.hosts.append(Host(ns, address))
        except BaseException:
            net.destroy()
            raise
        return net

    def destroy(self) -> None:
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces.clear()
