"""The spec's checkpoint retention (``checkpoints.keep_last``/``keep_every``), applied by the controller while an
attempt runs: each time the agents report new checkpoint files (message ``checkpoint_files``) and once more when
the attempt ends, the job's checkpoint directory is looked at again and the checkpoints the policy lets go are
deleted (:mod:`orchestrator.checkpoints.retention`), on a thread of its own so that the attempt's messages are
never held up. Every deletion is an event, ``checkpoints_pruned``: ``{"dir", "tags", "bytes", "kept", "failed",
"newest", "keep_last", "keep_every"}``.

Never deleted: anything newer than the newest complete checkpoint, what DeepSpeed's ``latest`` names, the
checkpoint a resume would start from (complete, not marked bad, its files the sizes recorded), the attempt's own
start checkpoint while no newer one is complete, an HF Trainer's best model.
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable

from ..checkpoints import CheckpointInfo
from ..checkpoints.deepspeed_layout import read_latest
from ..checkpoints.integrity import Choice
from ..checkpoints.retention import hf_best_tag, remove, select
from ..errors import StoreFullError
from ..observe.checkpoints import job_choice
from ..planning import JobPlan
from ..spec import JobSpec
from ..store import Store

__all__ = ["CheckpointPruner", "prune_now"]

#: Seconds the attempt's end waits for its last pass (deleting very large checkpoints takes a while).
FINAL_PASS_S = 120.0


def prune_now(store: Store, job_id: str, attempt: int, spec: JobSpec, plan: JobPlan,
              deleted: set[str] | None = None) -> dict | None:
    """One pass of the policy over the job's checkpoint directory (``plan.resume_dir``); the tags it deletes are
    added to ``deleted``.

    Returns:
        The ``checkpoints_pruned`` event's data when something was deleted (the event is recorded), else None.

    Raises:
        OSError, ValueError: the directory cannot be read as the spec's format.
    """
    policy = spec.checkpoints
    root = plan.resume_dir or plan.checkpoint_dir
    if policy.keep_last is None or not root:
        return None
    choice = job_choice(store, job_id, root, spec.resume.format, contents=False)
    complete = [i for i in choice.checkpoints if i.complete]
    if not complete:
        return None
    protect = _protected(choice, plan, complete[0])
    pruning = select(choice.checkpoints, policy.keep_last, policy.keep_every, protect)
    if not pruning.delete:
        return None
    freed, failed = remove([i.path for i in pruning.delete] + list(pruning.also))
    gone = [i.tag for i in pruning.delete if i.path in freed]
    if gone:
        store.forget_checkpoint_tags(job_id, root, gone)
        if deleted is not None:
            deleted.update(gone)
    data = {"dir": root, "tags": gone, "bytes": sum(freed.values()), "kept": dict(pruning.kept), "failed": failed,
            "newest": complete[0].tag, "keep_last": policy.keep_last, "keep_every": policy.keep_every}
    store.add_event(job_id, attempt, "checkpoints_pruned", data)
    return data


def _protected(choice: Choice, plan: JobPlan, newest: CheckpointInfo) -> dict[str, str]:
    """tag -> why it stays, whatever the counts say (see the module docstring)."""
    protect: dict[str, str] = {}
    latest = read_latest(choice.dir)
    if latest:
        protect[latest] = "DeepSpeed's latest names it"
    if choice.chosen is not None:
        protect.setdefault(choice.chosen.tag, "a resume would start from it")
    start = plan.resume_universal_from or plan.resume_tag
    by_tag = {i.tag: i for i in choice.checkpoints}
    if start and (start not in by_tag or by_tag[start].step >= newest.step):
        protect.setdefault(start, "this attempt started from it")
        if plan.resume_tag and plan.resume_tag != start:
            protect.setdefault(plan.resume_tag, "this attempt started from it")
    best = hf_best_tag(newest) if newest.format == "hf_trainer" else None
    if best:
        protect.setdefault(best, "the HF Trainer's best model (trainer_state.json)")
    return protect


class CheckpointPruner:
    """Runs :func:`prune_now` for one attempt on a thread of its own, at most one pass at a time; a pass asked
    for while one runs is done once it ends.

    Args:
        store, job_id, attempt: where the events go.
        spec, plan: the policy, the format and the directory; the attempt's start checkpoint.
        log: writes a line to the attempt's controller log (a pass that failed, with its traceback).
    """

    def __init__(self, store: Store, job_id: str, attempt: int, spec: JobSpec, plan: JobPlan,
                 log: Callable[[str], None]) -> None:
        self.store, self.job_id, self.attempt, self.spec, self.plan, self.log = store, job_id, attempt, spec, plan, log
        self.enabled = spec.checkpoints.prunes
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.deleted: set[str] = set()  # tags this attempt's passes deleted

    def seen(self) -> None:
        """New checkpoint files were reported: look again (returns at once)."""
        if not self.enabled:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"prune-{self.job_id}.{self.attempt}",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def close(self, timeout: float = FINAL_PASS_S) -> None:
        """The attempt ended: one last pass (what its final saves completed), waited for up to ``timeout`` s."""
        if not self.enabled:
            return
        self._closing = True
        self.seen()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self.deleted and not (thread and thread.is_alive()):  # files of a deleted tag hashed just before
            try:
                self.store.forget_checkpoint_tags(self.job_id, self.plan.resume_dir or self.plan.checkpoint_dir,
                                                  sorted(self.deleted))
            except StoreFullError:
                pass

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                prune_now(self.store, self.job_id, self.attempt, self.spec, self.plan, self.deleted)
            except StoreFullError as err:  # deleted, but neither the event nor the manifests' removal recorded
                self.log(f"checkpoint retention: what it deleted is not recorded: {err}")
            except Exception:  # noqa: BLE001 - retention must never stop the attempt
                self.log("checkpoint retention failed:\n" + traceback.format_exc())
            if self._closing and not self._wake.is_set():
                return
