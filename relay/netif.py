"""Which network interface a relay's transports listen on.

UCX (the `ucx` backend, and NIXL's UCX backend) opens a listening socket on every network
device it uses; limiting its devices to the interface that has the mesh's address keeps it
off every other network. `listen_device` picks that interface from a backend's `listen`
option (strict: an address no interface has is an error naming the option) or, unset, from
the published `host` (lenient: a host that is not a local address, e.g. a Kubernetes
Service name, leaves every interface on, with a warning).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Iterator

from omnirail.relay.base import RelayError

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
# Addresses that mean "every interface".
_EVERY = frozenset(("*", "0.0.0.0", "::", ""))

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _interface_addresses() -> Iterator[tuple[str, IPAddress]]:
    """(interface name, address) of this host: each interface's IPv4 address, and every
    IPv6 one (from /proc)."""
    for _, name in socket.if_nameindex():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            continue  # no IPv4 address on it
        yield name, ipaddress.IPv4Address(raw[20:24])
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 6:
                    yield parts[5], ipaddress.IPv6Address(bytes.fromhex(parts[0]))
    except OSError:
        pass  # no IPv6


def interface_of(address: str) -> str | None:
    """The name of the network interface that has `address` (an IP or a host name); None
    if no interface here has it. Raises OSError/ValueError when it does not resolve."""
    ips = {
        ipaddress.ip_address(str(info[4][0]).split("%")[0])
        for info in socket.getaddrinfo(address, None)
    }
    found = dict.fromkeys(name for name, ip in _interface_addresses() if ip in ips)
    if not found and any(ip.is_loopback for ip in ips):
        # 127.0.0.2 and the like: on the loopback interface, whose address is 127.0.0.1.
        found = dict.fromkeys(n for n, ip in _interface_addresses() if ip.is_loopback)
    return next(iter(found), None)


def listen_device(backend: str, listen: str | None, host: str | None) -> str | None:
    """The interface to listen on: that of `listen` (RelayError naming the option if none
    has it), else that of `host` (None, with a warning, if none has it); None: every
    interface ("*", "0.0.0.0", "::")."""
    address = listen if listen is not None else host
    if address is None or address.strip("[]") in _EVERY:
        return None
    address = address.strip("[]")
    try:
        device = interface_of(address)
    except (OSError, ValueError) as e:
        if listen is not None:
            raise RelayError(
                f"{backend} relay: option listen: cannot resolve {listen!r}: {e}"
            ) from None
        device = None
    if device is None and listen is not None:
        raise RelayError(f"{backend} relay: option listen: no network interface has {listen!r}")
    if device is None:
        log.warning(
            "%s relay: no network interface has the published host %r: listening on every "
            "interface (set option listen)",
            backend,
            host,
        )
    return device
