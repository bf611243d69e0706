"""The spec's ``restart`` section: when a FAILED attempt is restarted by itself (docs/recovery.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RestartPolicy", "RETRY_CAUSES", "CONTROLLER_CAUSES", "CONTROLLER_RESTARTS"]

RETRY_CAUSES = ("rank_exit", "node_lost", "gpu_fault", "no_progress", "startup_timeout", "provision_failed",
                "preflight_failed")
#: Causes that are orch's own trouble, not the job's: a controller that stalled (its agents' lease ran out)
#: or died. They are restarted whatever the policy says, and do not count against ``max_restarts``.
CONTROLLER_CAUSES = ("controller_stalled", "controller_lost")
#: Restarts in a row for the controller's own trouble, at most (a controller that keeps stalling is a
#: machine's problem a restart does not cure; the job then stays FAILED and says so).
CONTROLLER_RESTARTS = 3


class RestartPolicy(BaseModel):
    """When a FAILED attempt is restarted by itself (the spec's ``restart`` section).

    A restart is ``orch resume`` done by the controller: a new attempt from the last
    complete checkpoint, after ``backoff_seconds * backoff_factor ** (restarts so far)``
    seconds (at most ``max_backoff_seconds``), like torchrun's ``--max-restarts``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_restarts: int = Field(0, ge=0, le=10_000, description="Automatic restarts of the job at most; 0: none.")
    backoff_seconds: float = Field(5.0, ge=0, le=3600, description="Wait before the first restart.")
    backoff_factor: float = Field(2.0, ge=1, le=100, description="Each further restart waits this much longer.")
    max_backoff_seconds: float = Field(300.0, ge=0, le=86400, description="The longest wait.")
    retry_on: list[Literal["rank_exit", "node_lost", "gpu_fault", "no_progress", "startup_timeout",
                           "provision_failed", "controller_lost", "preflight_failed"]] = Field(
        default_factory=lambda: ["rank_exit", "node_lost", "gpu_fault", "no_progress", "startup_timeout",
                                 "controller_lost"],
        description="Causes of failure that are restarted (gpu_fault: a GPU's fatal Xid or double-bit ECC error). "
                    "The controller's own trouble (controller_stalled, "
                    "controller_lost: by the next orch server, for jobs an orch server ran) is restarted "
                    "whatever this says.")
    retry_exit_codes: list[int] | None = Field(None, description="Only rank exits with these codes are "
                                               "restarted (a signal is its negative number); null: any.")
    exclude_failed_nodes: bool = Field(False, description="Restart without a lost node (a spare host of the "
                                       "hostfile takes its place).")

    def backoff(self, restarts_so_far: int) -> float:
        """Seconds to wait before restart number ``restarts_so_far + 1``."""
        return min(self.max_backoff_seconds, self.backoff_seconds * self.backoff_factor ** restarts_so_far)

    def retries(self, cause: dict | None) -> bool:
        """Whether a failure with ``cause`` (an attempt's cause dict) is one this policy restarts (the
        controller's own trouble, :data:`CONTROLLER_CAUSES`, is restarted whatever it says)."""
        kind = (cause or {}).get("kind")
        if kind in CONTROLLER_CAUSES:
            return True
        if kind not in self.retry_on:
            return False
        if kind == "rank_exit" and self.retry_exit_codes is not None:
            return (cause or {}).get("returncode") in self.retry_exit_codes
        return True
