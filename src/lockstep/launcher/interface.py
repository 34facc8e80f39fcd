"""The network interface a node's ranks use: the one whose address routes to the master.

Gloo and NCCL pick an interface by resolving the host's name, which on many hosts gives the
loopback address or the address of another network than the one the master is on (a multi-homed
host: a management network beside the cluster's). The launcher asks the kernel instead: a UDP
socket "connected" to the master's address sends nothing, yet gets the source address the routing
table chooses, and the interface that holds that address is the one to use. The ranks get it as
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` where the user left them unset. A master on
the loopback address (every node on one host) leaves the ranks' own choice alone.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lockstep.launcher import resolver

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Route:
    interface: str
    address: str


def route_to(host: str, interrupted: Callable[[], bool] | None = None) -> Route | None:
    """The interface and local address this host reaches ``host`` from (None: no route, or the
    name does not resolve, within the resolver's deadline or until ``interrupted()``)."""
    try:
        infos = resolver.getaddrinfo(host, 9, kind=socket.SOCK_DGRAM, interrupted=interrupted)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)  # UDP: no packet leaves, the kernel only picks the route
                local = probe.getsockname()[0]
        except OSError:
            continue
        name = _interface_of(local)
        if name is not None:
            return Route(name, local)
    return None


def _interface_of(address: str) -> str | None:
    import psutil  # only multi-node launches ask

    wanted = address.split("%", 1)[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == wanted for a in addresses):
            return name
    return None


def interface_env(master_addr: str, env: Mapping[str, str],
                  interrupted: Callable[[], bool] | None = None) -> tuple[dict[str, str], str]:
    """The variables to add to the ranks' environment (those of IFNAME_VARIABLES that ``env``
    leaves unset), and the line ``-v`` prints about them (looking up ``master_addr`` stops early
    when ``interrupted()``)."""
    unset = [v for v in IFNAME_VARIABLES if not env.get(v)]
    preset = ", ".join(f"{v}={env[v]}" for v in IFNAME_VARIABLES if env.get(v))
    if not unset:
        return {}, f"ranks use the interfaces that {preset} name"
    route = route_to(master_addr, interrupted)
    if route is None:
        return {}, (f"no interface of this host routes to the master {master_addr}: the ranks pick one "
                    f"themselves (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose)")
    if ipaddress.ip_address(route.address).is_loopback:  # every node on this host: nothing to choose
        return {}, (f"the master {master_addr} is on this host's loopback interface: the ranks pick an "
                    f"interface themselves")
    also = f"; {preset} as set" if preset else ""
    return dict.fromkeys(unset, route.interface), (
        f"ranks use the interface {route.interface} ({route.address}), which routes to the master "
        f"{master_addr}, for {' and '.join(unset)}{also}")
