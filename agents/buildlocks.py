"""Stale torch extension build locks: the ``lock`` file a killed build leaves, on which every later rank
that builds the same op waits forever.

DeepSpeed JIT-builds its ops with ``torch.utils.cpp_extension.load``, which takes a ``FileBaton``: it
creates ``<extensions dir>/<op>/lock`` (``O_EXCL``), runs ``ninja`` in ``<extensions dir>/<op>``, and
removes the file when done. A build killed midway leaves the file behind, and the next build polls
for it to go, with no deadline. A lock is stale here when it is older than :data:`STALE_S` and no
process on this node works in its directory (``ninja`` and the compilers run there).
"""

from __future__ import annotations

import glob
import os
import time
from typing import Mapping

__all__ = ["extensions_dir", "stale_locks", "STALE_S"]

#: A build lock younger than this is taken to belong to a build still starting (seconds).
STALE_S = 120.0


def extensions_dir(env: Mapping[str, str]) -> str:
    """Where the ranks' torch extensions are built: ``$TORCH_EXTENSIONS_DIR``, else torch's default
    ``~/.cache/torch_extensions`` (``torch.utils.cpp_extension._get_build_directory``)."""
    return os.path.expanduser(env.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or "~", ".cache"), "torch_extensions"))


def _busy_dirs() -> set[str]:
    """The working directories of this node's processes (the ones this user may read)."""
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.add(os.readlink(f"/proc/{pid}/cwd"))
            except OSError:
                continue
    return out


def stale_locks(env: Mapping[str, str], older_than_s: float = STALE_S, now: float | None = None) -> list[tuple[str, float]]:
    """Stale build locks under the ranks' extensions directory (two levels: ``<py>_<accelerator>/<op>/lock``
    or ``<op>/lock``): ``(path, age in seconds)``, oldest first."""
    root = extensions_dir(env)
    now = time.time() if now is None else now
    found = []
    busy: set[str] | None = None
    for path in glob.glob(os.path.join(glob.escape(root), "*", "lock")) + \
            glob.glob(os.path.join(glob.escape(root), "*", "*", "lock")):
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            continue  # removed meanwhile: a build finished
        if age < older_than_s:
            continue
        busy = _busy_dirs() if busy is None else busy
        build = os.path.dirname(path)
        if any(d == build or d.startswith(build + os.sep) for d in busy):
            continue
        found.append((path, age))
    return sorted(found, key=lambda f: -f[1])
