"""The state directory is private to its user: directories 0700, files 0600 (docs/security.md).

New files get those modes from the umask the controller and the agents run with
(``agents.ranks.private_files``); :func:`make_private` fixes what exists from before: the state
directory itself and its store files on every controller start, and (``walk=True``, ``orch server``'s
start) everything under it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import OrchError

__all__ = ["make_private", "open_state_dir"]

_STORE_FILES = ("orch.db", "orch.db-wal", "orch.db-shm", "orch.db-journal", "server.json", "server.token",
                "audit.log")


def _fix(path: str, mode: int) -> bool:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o077 == 0:
            return False
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700 or mode)
        return True
    except OSError:  # gone meanwhile, or not ours: left as it is
        return False


def open_state_dir(state_dir: Path) -> None:
    """Create the state directory if it is missing, then make it and its store files private (also those
    from before: :func:`make_private`).

    Raises:
        OrchError: it cannot be created (a path under a file, a read-only or missing mount), naming it.
    """
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OrchError(f"Cannot use state dir {state_dir}: {err.strerror or err} (give --state-dir, or "
                        "$ORCH_STATE_DIR, a directory you can write).") from err
    make_private(Path(state_dir))


def make_private(state_dir: Path, walk: bool = False, keep: tuple[Path, ...] = ()) -> int:
    """Take group and other permissions away from the state directory and its store files (and with
    ``walk``, from everything under it but the directories in ``keep``, e.g. Prometheus' targets;
    symbolic links are not followed). Returns how many were changed.

    The owner's own bits stay (an executable stays executable); only group and other bits go.
    """
    root = Path(state_dir)
    changed = int(_fix(str(root), 0o700))
    for name in _STORE_FILES:
        changed += _fix(str(root / name), 0o600)
    kept = {os.path.abspath(k) for k in keep}
    if walk:
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.abspath(os.path.join(top, d)) not in kept]
            changed += sum(_fix(os.path.join(top, d), 0o700) for d in dirs)
            changed += sum(_fix(os.path.join(top, f), 0o600) for f in files)
    return changed
