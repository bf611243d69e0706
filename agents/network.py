"""Which network interface a node's ranks use for their collectives: the one that reaches the master.

Left to themselves, gloo and NCCL guess. gloo resolves the node's hostname and listens on that
address; where the hostname resolves to a loopback address (Debian's ``127.0.1.1`` line in
``/etc/hosts``, every network-namespace host) it listens on loopback, and every other node that
connects to it is refused or reaches itself (``remote=[127.0.0.1]`` in its stack trace). NCCL's
socket transport and bootstrap have the same trap. So the agent names the interface for them:
``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` are set, on every rank that does not already have
them (the user's own value wins), to the interface that holds the address this node's route to the
master address starts from: the address the other nodes reach this node at.

Nothing here sends or starts anything: the route is read with an unconnected UDP socket
(``connect`` on a datagram socket only asks the kernel which source address it would use).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["IFNAME_VARS", "Choice", "choose", "interfaces", "this_machine_names"]

#: The variables that name the interface of the ranks' collectives (gloo's and NCCL's).
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Choice:
    """What the agent decided for its node's ranks.

    Attributes:
        sets: the variables to set where a rank's environment lacks them (``{}``: nothing to set).
        user: the variables of :data:`IFNAME_VARS` the ranks' environment already has (they win).
        ifname, address: the interface chosen (or the user's) and its address; None when none could be.
        detail: one sentence saying what was chosen and why, or what is wrong.
        problem: why the ranks' collectives cannot work as things are, or None.
    """

    sets: Mapping[str, str] = field(default_factory=dict)
    user: Mapping[str, str] = field(default_factory=dict)
    ifname: str | None = None
    address: str | None = None
    detail: str = ""
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the agent's ``started`` message and the preflight's ``network`` check carry it)."""
        return {"sets": dict(self.sets), "user": dict(self.user), "ifname": self.ifname, "address": self.address,
                "detail": self.detail, "problem": self.problem}


def interfaces() -> dict[str, list[str]]:
    """``{interface: [IPv4 and IPv6 addresses]}`` of this node (of the network namespace it runs in)."""
    import psutil  # (here: orch plan reads IFNAME_VARS only, without psutil's ~10 ms import)
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
    return out


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _source_address(master_addr: str, port: int) -> tuple[str, str]:
    """``(the master's address, this node's source address towards it)``.

    Raises:
        OSError: the name does not resolve, or there is no route to it.
    """
    infos = socket.getaddrinfo(master_addr, port or 9, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(sockaddr[0]), str(s.getsockname()[0])


def _hostname_note() -> str:
    """What this node's hostname resolves to, when that is a loopback address (gloo would listen there)."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return ""
    if not _is_loopback(address):
        return ""
    return (f"; this node's hostname {name} resolves to {address}, a loopback address, so gloo left to itself "
            "would listen there and no other node could connect")


def _route(master: Mapping[str, Any] | None, have: Mapping[str, list[str]], spans_hosts: bool) -> Choice:
    """The interface holding this node's source address towards the master."""
    if not master or not master.get("addr"):
        return Choice(detail="no master address in the plan: gloo and NCCL choose their interface themselves")
    addr, port = str(master["addr"]), int(master.get("port") or 0)
    try:
        target, source = _source_address(addr, port)
    except OSError as err:
        why = err.strerror or str(err)
        return Choice(detail=f"no interface reaches the master address {addr}: {why}{_hostname_note()}",
                      problem=f"no route from this node to the master address {addr} ({why})")
    ifname = next((name for name, addresses in have.items() if source in addresses), None)
    if ifname is None:
        return Choice(detail=f"the route to the master {target} starts from {source}, which no interface of this "
                      "node holds", problem=f"no interface holds {source}, the source address towards the master")
    if spans_hosts and _is_loopback(source):
        return Choice({}, {}, ifname, source, f"the master address {addr} ({target}) is a loopback address on this "
                      "node, and the job spans hosts: the other nodes cannot reach it; set master_addr to node 0's "
                      "address on the network the nodes share",
                      problem=f"the master address {addr} is a loopback address and the job spans hosts")
    return Choice({var: ifname for var in IFNAME_VARS}, {}, ifname, source,
                  f"{ifname} ({source}) routes to the master {target}")


def _named(user: Mapping[str, str]) -> list[str]:
    """The interface names the job's environment requires to exist: every name of
    ``GLOO_SOCKET_IFNAME`` (a comma-separated list, exact names) and an exact ``=name`` of
    ``NCCL_SOCKET_IFNAME`` (NCCL also takes prefixes and ``^`` exclusions, which name no one interface)."""
    names = [n.strip() for n in user.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    nccl = user.get("NCCL_SOCKET_IFNAME", "")
    if nccl.startswith("=") and "," not in nccl:
        names.append(nccl[1:].strip())
    return list(dict.fromkeys(names))


def _user_interface(user: Mapping[str, str], have: Mapping[str, list[str]], spans_hosts: bool) -> Choice:
    """The interface(s) the job's environment names: they must exist here (and, when the job spans
    hosts, not be loopback)."""
    given = ", ".join(f"{k}={v}" for k, v in user.items())
    names = _named(user)
    missing = [n for n in names if n not in have]
    if missing:
        return Choice({}, user, None, None, f"{given} (the job's environment) names {', '.join(missing)}, which "
                      f"this node has no interface of (its interfaces: {', '.join(sorted(have)) or 'none'})",
                      problem=f"{given} names no interface {', '.join(missing)} on this node")
    if not names:
        return Choice({}, user, None, None, f"{given} (the job's environment): left to NCCL as written")
    name = names[0]
    addresses = have[name]
    address = next((a for a in addresses if ":" not in a), addresses[0] if addresses else None)
    if spans_hosts and address is not None and _is_loopback(address):
        return Choice({}, user, name, address, f"{given} is a loopback interface, and the job spans hosts: the "
                      "other nodes cannot reach this one there", problem=f"{given} is a loopback interface")
    return Choice({}, user, name, address, f"{given} (the job's environment): {name} has "
                  f"{', '.join(addresses) or 'no address'}")


def choose(env: Mapping[str, str], master: Mapping[str, Any] | None) -> Choice:
    """Decide the interface of this node's collectives.

    Args:
        env: a rank's environment as it would start (the node's, the launcher's and the spec's
            variables): a ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` there is the user's and wins.
        master: ``{"addr", "port", "spans_hosts"}`` from the node's plan (``spans_hosts``: the job's
            nodes are on more than one machine, so a loopback master cannot work), or None.

    Returns:
        The :class:`Choice`: the variables to set (each of :data:`IFNAME_VARS` the environment lacks,
        to the interface of the route to the master) and ``problem`` when the ranks' collectives cannot
        work: the user's interface does not exist here, there is no route to the master, or the route
        (or the user's interface) is loopback while the job spans hosts.
    """
    have = interfaces()
    user = {k: env[k] for k in IFNAME_VARS if env.get(k)}
    spans_hosts = bool((master or {}).get("spans_hosts"))
    route = _route(master, have, spans_hosts)
    if not user:
        if not route.sets:
            return route
        return replace(route, detail=f"{route.detail}: {' and '.join(route.sets)} set to {route.ifname}")
    own = _user_interface(user, have, spans_hosts)
    missing = [var for var in IFNAME_VARS if var not in user]
    sets = {var: route.ifname for var in missing if route.ifname and not route.problem}
    detail = own.detail + (f"; {route.detail}" + (f": {', '.join(sets)} set to {route.ifname}" if sets else "")
                           if missing else "")
    return Choice(sets, user, own.ifname, own.address, detail, own.problem or route.problem)


def this_machine_names() -> set[str]:
    """The names and addresses this machine answers to: loopback's, its host name and FQDN, and every IPv4
    and IPv6 address of its interfaces (a zone suffix dropped)."""
    import psutil
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    names |= {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family in (socket.AF_INET, socket.AF_INET6)}
    return names
