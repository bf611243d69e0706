"""What users see of their jobs: controller metrics, Prometheus targets files, the views the CLI, API
and dashboard show.

May import: ``orchestrator.errors``, ``orchestrator.checkpoints``, ``orchestrator.store``.
"""

from typing import TYPE_CHECKING

from .. import lazy_names

#: Where each name lives; imported on first use (PEP 562): the CLI's views need no prometheus_client.
_WHERE = {"next_steps": "hints",
          **dict.fromkeys(("ControllerMetrics", "TargetsWriter", "attempt_targets", "default_targets_dir"), "metrics"),
          **dict.fromkeys(("job_detail", "job_list", "job_summary", "log_path", "node_rows", "progress_of", "rank_rows",
                           "read_log"), "views")}

if TYPE_CHECKING:
    from .hints import next_steps
    from .metrics import ControllerMetrics, TargetsWriter, attempt_targets, default_targets_dir
    from .views import job_detail, job_list, job_summary, log_path, node_rows, progress_of, rank_rows, read_log


__getattr__ = lazy_names(__name__, _WHERE)

__all__ = ["ControllerMetrics", "TargetsWriter", "attempt_targets", "default_targets_dir", "job_summary", "job_list",
           "job_detail", "next_steps", "rank_rows", "node_rows", "read_log", "progress_of", "log_path"]
