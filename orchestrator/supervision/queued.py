"""An attempt waiting for a scheduler to grant its nodes (the slurm provisioner from a login node).

Such an attempt cannot be planned before Slurm says which nodes it gets, so :class:`QueuedAttempt`
runs on its own thread: it asks for the allocation (:meth:`SlurmProvisioner.allocate`), the job staying
PENDING meanwhile (``allocation`` events say what Slurm says), then plans and starts the attempt inside
it. A cancel while queued cancels the request (``scancel``) and the job becomes CANCELLED; a refused
request, a queue deadline passed or a plan that does not fit the nodes granted make it FAILED with
cause ``allocation`` (the allocation then cancelled). Nothing here waits forever: the queue has the
spec's ``slurm.queue_timeout``.
"""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import Callable

from ..errors import OrchError, SpecError
from ..provisioners import Provisioner
from ..spec import JobSpec
from ..store import JobState, Store

__all__ = ["QueuedAttempt", "allocation_size"]


def allocation_size(spec: JobSpec, hostfile_pool: Callable[[], list[tuple[str, int]]]) -> tuple[int, int, list[str] | None]:
    """What an attempt asks the scheduler for: ``(nodes, slots per node, hosts or None)``.

    With a hostfile, its hosts left by the filters (``hostfile_pool()``: ``[(host, slots)]``), each
    asked for by name, with the most slots any has; without one, ``num_nodes`` nodes with ``num_gpus``
    (else 1) slots each: the same fields DeepSpeed's runner reads (``--num_nodes``, ``--num_gpus``).

    Raises:
        SpecError: no hostfile and no ``num_nodes``; HostfileError, FilterError from the hostfile.
    """
    if spec.hostfile:
        pool = hostfile_pool()
        return len(pool), max(slots for _, slots in pool), [host for host, _ in pool]
    if spec.num_nodes < 1:
        raise SpecError("num_nodes: outside a Slurm allocation orch asks Slurm for num_nodes nodes (and num_gpus "
                        "slots on each, default 1); set num_nodes, give a hostfile, or run inside salloc/sbatch.")
    return spec.num_nodes, spec.num_gpus if spec.num_gpus > 0 else 1, None


class QueuedAttempt:
    """Attempt ``number`` of a job, waiting for its allocation on its own thread (module docstring).

    Args:
        store: the job's store (state, events).
        job_id, number: the job and the attempt to be.
        spec: the job's spec (its ``exclude_hosts`` are not asked for).
        provisioner: one whose ``needs_allocation()`` is true.
        size: :func:`allocation_size`'s ``(nodes, slots, hosts)``.
        run_dir: the attempt's run directory (the batch script's output goes there).
        start: plans and starts the attempt on the provisioner granted (raises OrchError if it cannot).
    """

    def __init__(self, store: Store, job_id: str, number: int, spec: JobSpec, provisioner: Provisioner,
                 size: tuple[int, int, list[str] | None], run_dir: str, start: Callable[[Provisioner], None]) -> None:
        self.store, self.job_id, self.number = store, job_id, number
        self.spec, self.provisioner, self.size, self.run_dir, self._start = spec, provisioner, size, run_dir, start
        self.cancel_event = threading.Event()
        self.cancel_reason = "cancelled by the user"
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"queued-{job_id}.{number}", daemon=True)

    def start(self) -> None:
        """Start waiting, on a new thread."""
        self._thread.start()

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Cancel the request (any thread); the job becomes CANCELLED once Slurm was told."""
        self.cancel_reason = reason
        self.cancel_event.set()

    def _note(self, kind: str, data: dict) -> None:
        self.store.add_event(self.job_id, self.number, kind, data)

    def _main(self) -> None:
        granted = None
        try:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            nodes, slots, hosts = self.size
            granted = self.provisioner.allocate(  # type: ignore[attr-defined]
                f"orch-{self.job_id}-{self.number}", nodes, slots, str(Path(self.run_dir) / "slurm-%j.out"), hosts,
                list(self.spec.exclude_hosts), self._note, self.cancel_event)
            if granted is None or self.cancel_event.is_set():
                self._end(JobState.CANCELLED, {"kind": "cancelled", "message": self.cancel_reason})
                return
            self._start(granted)
            granted = None  # the attempt owns it now: its teardown cancels the allocation
        except OrchError as err:
            self._end(JobState.FAILED, {"kind": "allocation", "message": str(err)})
        except Exception as err:  # noqa: BLE001 - an orch bug must still leave no allocation behind
            (Path(self.run_dir) / "controller.log").open("a").write(traceback.format_exc())
            self._end(JobState.FAILED, {"kind": "internal_error", "message": f"orch internal error: {err!r} "
                                        f"(details in {self.run_dir}/controller.log)"})
        finally:
            if granted is not None:
                granted.close()
            self.done.set()

    def _end(self, state: JobState, cause: dict) -> None:
        try:
            self.store.set_state(self.job_id, state, cause=cause, queued=True)
        except OrchError:  # a state recorded meanwhile (the controller shut down)
            pass
