"""One thread that reads many agents' message streams: the controller's side of :mod:`agents.link` without a
thread per agent.

A controller of 1,000 nodes used to hold one reader thread per agent (``agents.link.MessageReader``), each
waking for every heartbeat. :class:`LinkHub` waits on all of their file descriptors at once with
:mod:`selectors` (epoll on Linux), reads what is ready without blocking, splits it into lines and puts each
decoded message on the sink its stream was registered with, as ``(tag, message)``, in the order the stream
sent them, then ``(tag, {"type": "eof"})`` once when the stream ends, exactly as a ``MessageReader`` with a
sink does. Streams whose reading cannot be multiplexed (no file descriptor) keep a thread of their own
(``MessageReader`` decides: :func:`source_of`).

A line longer than :data:`MAX_LINE` bytes without a newline is cut there and handed on as a garbage message
(one agent cannot make the hub hold unbounded memory).
"""

from __future__ import annotations

import os
import queue
import selectors
import socket
import threading
from typing import Any, Callable

from .link import decode

__all__ = ["LinkHub", "shared_hub", "source_of", "MAX_LINE"]

#: The longest line (bytes) the hub buffers for one stream before it hands the part on.
MAX_LINE = 16 * 1024 * 1024
_CHUNK = 65536


def source_of(stream: Any) -> tuple[int, Callable[[int], bytes]] | None:
    """``(file descriptor, read(n) -> bytes)`` to multiplex ``stream``, or None where it has none.

    A stream may say so itself with ``hub_source()`` (an SSH channel: the descriptor that signals data and its
    own ``recv``); a raw pipe or socket file (``fileno()``) is read with :func:`os.read`. The descriptor is put
    in non-blocking mode: the stream must not be read by anything else afterwards.
    """
    custom = getattr(stream, "hub_source", None)
    if custom is not None:
        return custom()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    try:
        os.set_blocking(fd, False)
    except OSError:
        return None
    return fd, lambda n: os.read(fd, n)


class _Link:
    __slots__ = ("fd", "read", "sink", "tag", "buffer")

    def __init__(self, fd: int, read: Callable[[int], bytes], sink: "queue.Queue[tuple[Any, dict]]", tag: Any):
        self.fd, self.read, self.sink, self.tag = fd, read, sink, tag
        self.buffer = b""


class LinkHub:
    """Reads every registered stream on one daemon thread (see the module docstring).

    Example::

        hub = LinkHub()
        hub.add(fd, lambda n: os.read(fd, n), events, tag=3)   # (3, msg) ... then (3, {"type": "eof"})

    The thread starts with the first :meth:`add` and runs for the life of the process (it sleeps in the
    selector when nothing is registered).
    """

    def __init__(self, name: str = "link-hub") -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[_Link] = []
        self._name = name
        self._thread: threading.Thread | None = None
        self.links = 0  # streams registered and not yet ended

    def add(self, fd: int, read: Callable[[int], bytes], sink: "queue.Queue[tuple[Any, dict]]", tag: Any) -> None:
        """Read ``fd`` (readable means ``read(n)`` returns data, or b"" at its end) into ``sink`` as
        ``(tag, message)``; ``(tag, {"type": "eof"})`` follows the last message once."""
        with self._lock:
            self._pending.append(_Link(fd, read, sink, tag))
            self.links += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def watch(self, stream: Any, sink: "queue.Queue[tuple[Any, dict]]", tag: Any) -> bool:
        """:meth:`add` ``stream`` where it can be multiplexed (:func:`source_of`); False (nothing done) where it
        cannot, and its reader needs a thread of its own."""
        source = source_of(stream)
        if source is None:
            return False
        self.add(source[0], source[1], sink, tag)
        return True

    def _take_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for link in pending:
            try:
                self._selector.register(link.fd, selectors.EVENT_READ, link)
            except (ValueError, OSError):  # closed before we got to it
                self._end(link, registered=False)

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self._take_pending()
                else:
                    self._read(key.data)

    def _read(self, link: _Link) -> None:
        try:
            chunk = link.read(_CHUNK)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return  # readable but nothing after all (a channel's signal ahead of its data)
        except Exception:  # OSError, EOFError, paramiko's SSHException: the link is gone
            chunk = b""
        if not chunk:
            self._end(link)
            return
        data = link.buffer + chunk
        *lines, link.buffer = data.split(b"\n")
        for line in lines:
            if line.strip():
                link.sink.put((link.tag, decode(line)))
        if len(link.buffer) > MAX_LINE:
            link.sink.put((link.tag, decode(link.buffer)))
            link.buffer = b""

    def _end(self, link: _Link, registered: bool = True) -> None:
        if registered:
            try:
                self._selector.unregister(link.fd)
            except (KeyError, ValueError, OSError):
                pass
        if link.buffer.strip():
            link.sink.put((link.tag, decode(link.buffer)))
        link.buffer = b""
        link.sink.put((link.tag, {"type": "eof"}))
        with self._lock:
            self.links -= 1


_shared: LinkHub | None = None
_shared_lock = threading.Lock()


def shared_hub() -> LinkHub:
    """The process's one hub (made on first use), which the controller's provisioners register with."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LinkHub()
        return _shared
