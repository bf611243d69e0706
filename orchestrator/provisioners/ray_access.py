"""Reaching a Ray cluster the way Ray's own tools do, and reading it without joining it.

* **Which cluster.** ``auto`` is ``$RAY_ADDRESS``, else what ``ray status`` finds on this machine: the
  cluster ``ray start`` recorded in Ray's default temp dir, else a running GCS found in the process
  table (so a cluster started with ``ray start --temp-dir ...`` is found too).
* **Token authentication** (Ray 2.60: ``RAY_AUTH_MODE=token``). Ray turns it on for a cluster by
  itself: every local ``ray.init()`` writes ``~/.ray/auth_token``, and a later ``ray start --head``
  that finds that file enables it. A driver that connects to an explicit address never turns it on
  by itself, and a driver without it is refused (``InvalidAuthToken``) for 20 s before Ray says only
  "Failed to connect". So orch, where ``RAY_AUTH_MODE`` is unset and a token is available
  (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), connects in token mode
  (a cluster without authentication accepts a token it does not ask for), and says so plainly when
  the cluster refuses it.
* **Reading without joining.** ``orch plan`` and the checks before a job starts read the cluster's
  nodes from its GCS (``GcsClient``), which starts no driver, worker or session; a node Ray still
  lists as alive is checked by connecting to its raylet's port (Ray takes 15 s to a minute to
  declare a node dead).
* **Leaving nothing.** A Ray that orch starts for a job (``address: local``) is shut down when orch
  exits, and its session directory (``/tmp/ray/session_*``) removed.

These use Ray's own functions where Ray has them (``ray._private.services``,
``ray._raylet.GcsClient``, ``AuthenticationTokenLoader``): private names of the installed Ray
(2.60), each behind one function here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from agents import network

from ..errors import ProvisionError

__all__ = ["resolve_address", "check_reachable", "token_auth", "gcs_nodes", "read_nodes", "unreachable_nodes", "remove_session_on_exit",
           "is_auth_error", "auth_message", "local_node_ip", "local_addresses"]

#: Where ``ray.init()`` and ``ray get-auth-token --generate`` keep the token.
DEFAULT_TOKEN = "~/.ray/auth_token"


def resolve_address(address: str) -> str:
    """The GCS address (``host:port``) of ``auto``, as ``ray status`` finds it; other addresses as given.

    Raises:
        ProvisionError: ``auto`` finds no cluster, or several (naming them).
    """
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._private import services
    try:
        return str(services.canonicalize_bootstrap_address_or_die("auto"))
    except ConnectionError as err:
        found = "several Ray clusters run on this machine" if "multiple" in str(err) else \
            "no Ray cluster runs on this machine"
        raise ProvisionError(f"ray.address is 'auto' but {found} (as `ray status` finds them: {err}) and $RAY_ADDRESS "
                             "is unset; start one with `ray start --head`, or set ray.address to its "
                             "host:port") from None


def _token_source() -> str | None:
    """Where a Ray token is available to this process, or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"$RAY_AUTH_TOKEN_PATH ({path})" if os.path.isfile(os.path.expanduser(path)) else None
    default = os.path.expanduser(DEFAULT_TOKEN)
    return default if os.path.isfile(default) else None


@contextlib.contextmanager
def token_auth() -> Iterator[tuple[bool, str]]:
    """Ray's token mode for this process, where ``RAY_AUTH_MODE`` is unset and a token is available,
    while the ``with`` block connects (Ray reads the mode from the environment into its cached config;
    the variable is removed again afterwards, so the controller's own environment, which local ranks
    inherit, stays as it was).

    Yields:
        ``(token mode on, how it was decided)``, e.g. ``(True, "a token is in ~/.ray/auth_token")``.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        yield mode.lower() == "token", f"RAY_AUTH_MODE={mode} (set in this environment)"
        return
    source = _token_source()
    if source is None:
        yield False, (f"no token: $RAY_AUTH_TOKEN and $RAY_AUTH_TOKEN_PATH are unset and {DEFAULT_TOKEN} does "
                      "not exist")
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        try:
            from ray._raylet import Config
            Config.initialize("")  # Ray caches its config: re-read RAY_AUTH_MODE
        except (ImportError, AttributeError):
            pass
        yield True, f"a token is in {source}"
    finally:
        os.environ.pop("RAY_AUTH_MODE", None)


def is_auth_error(err: BaseException) -> bool:
    """Whether Ray refused a connection for its token (missing, or not the cluster's)."""
    text = f"{type(err).__name__} {err}"
    return "AuthenticationError" in text or "InvalidAuthToken" in text or "Unauthenticated" in text


def auth_message(address: str, token_mode: bool, how: str) -> str:
    """The error for a cluster that refused this controller's token (or its lack of one)."""
    if token_mode:
        what = (f"refused the token orch sent ({how}): it is not the cluster's. Give orch the cluster's token: "
                "$RAY_AUTH_TOKEN, or $RAY_AUTH_TOKEN_PATH naming a file holding it (`ray get-auth-token` on the "
                "head node prints it)")
    else:
        what = (f"requires token authentication, and orch has {how}. Give orch the cluster's token: "
                f"$RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, or the file {DEFAULT_TOKEN} (`ray get-auth-token` on the "
                "head node prints it)")
    return f"the Ray cluster at {address} {what}"


def gcs_nodes(address: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The cluster's nodes, read from its GCS at ``address`` without joining it (no driver, worker or
    session), in the shape of ``ray.nodes()``: ``NodeID``, ``Alive``, ``NodeManagerAddress``,
    ``NodeManagerHostname``, ``NodeManagerPort``, ``Resources``. Uses this process's auth mode as it is.

    Raises:
        Exception: what Ray raises (``AuthenticationError``, ``RpcError``, ...).
    """
    from ray._raylet import GcsClient
    infos = GcsClient(address=address).get_all_node_info(timeout=timeout)
    return [{"NodeID": info.node_id.hex(), "Alive": info.state == 0, "NodeManagerAddress": info.node_manager_address,
             "NodeManagerHostname": info.node_manager_hostname, "NodeManagerPort": info.node_manager_port,
             "Resources": dict(info.resources_total)} for info in infos.values()]


def check_reachable(target: str, timeout: float) -> None:
    """A TCP connection to the GCS at ``host:port`` (Ray's own clients retry a closed port for minutes).

    Raises:
        ProvisionError: nothing answers there within ``timeout`` (at most 10) seconds.
    """
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout, 10.0)):
            pass
    except (OSError, ValueError) as err:
        raise ProvisionError(f"cannot reach the Ray cluster at {target}: "
                             f"{getattr(err, 'strerror', None) or err}") from err


def read_nodes(address: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """:func:`gcs_nodes` of the cluster ``address`` names (``auto`` resolved), in token mode where a token
    is available (:func:`token_auth`).

    Raises:
        ProvisionError: no cluster is found, or its GCS cannot be reached or refuses this controller.
    """
    target = resolve_address(address)
    if target.startswith("ray://"):
        raise ProvisionError(f"the nodes of {target} cannot be read without joining it through Ray Client")
    check_reachable(target, timeout)
    with token_auth() as (token_mode, how):
        try:
            return gcs_nodes(target, timeout)
        except Exception as err:  # noqa: BLE001 - Ray raises RpcError, AuthenticationError, ...
            if is_auth_error(err):
                raise ProvisionError(auth_message(target, token_mode, how)) from err
            raise ProvisionError(f"cannot read the Ray cluster at {target}: {err}") from err


def unreachable_nodes(nodes: list[dict[str, Any]], timeout: float = 2.0) -> dict[str, str]:
    """Nodes Ray lists as alive whose raylet does not answer a TCP connection (its host died or was cut
    off before Ray noticed): ``{node id: why}``. Probed in parallel, each within ``timeout`` seconds."""
    def probe(node: dict[str, Any]) -> tuple[str, str | None]:
        addr, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
        if not addr or not port:
            return node["NodeID"], None
        try:
            with socket.create_connection((addr, int(port)), timeout=timeout):
                return node["NodeID"], None
        except OSError as err:
            why = "no answer" if isinstance(err, (socket.timeout, TimeoutError)) else (err.strerror or str(err))
            return node["NodeID"], f"its raylet at {addr}:{port} does not answer ({why})"
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(alive))) as pool:
        return {node_id: why for node_id, why in pool.map(probe, alive) if why}


def local_addresses() -> set[str]:
    """Every address of this machine's interfaces (of the network namespace this process runs in)."""
    return {address for addresses in network.interfaces().values() for address in addresses}


def local_node_ip() -> str:
    """The address a Ray started here would give its node (Ray's own choice: the source address of
    this machine's route outwards, else loopback); nothing is started."""
    from ray._private import services
    try:
        return str(services.get_node_ip_address())
    except Exception:  # noqa: BLE001 - no route at all
        return "127.0.0.1"


def remove_session_on_exit(ray: Any) -> None:
    """When this process exits: shut the Ray it started down, then remove its session directory (and the
    ``session_latest`` link to it). Call right after the ``ray.init()`` that started a local Ray."""
    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    session = node.get_session_dir_path() if node is not None else None
    if not session:
        return

    def remove() -> None:
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        latest = Path(session).parent / "session_latest"
        try:
            if latest.is_symlink() and os.path.realpath(latest) == os.path.realpath(session):
                latest.unlink()
        except OSError:
            pass
        shutil.rmtree(session, ignore_errors=True)

    atexit.register(remove)
