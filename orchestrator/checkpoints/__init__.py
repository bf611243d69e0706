"""Checkpoints on disk in every format orch reads (orch's marker, DeepSpeed, HF Trainer, Accelerate):
which are complete, which are damaged since their save (the manifest), DeepSpeed's universal
conversion, export.

May import: ``orchestrator.errors``, ``agents.manifest`` (the hash the agents record). Reads checkpoint
directories; writes only DeepSpeed's ``latest`` (``formats.point_latest``) and orch's own conversions;
runs DeepSpeed's converter as a subprocess.
"""

from typing import TYPE_CHECKING

from .. import lazy_names

#: Where each name lives; imported on first use (PEP 562), so that ``orch plan``, which only asks
#: :mod:`.detect` which format a (usually missing) directory holds, does not load every format (~25 ms of imports)
_WHERE = {
    **dict.fromkeys(("ExportResult", "choose_tag", "consolidated_state_dict", "export_checkpoint"), "export"),
    **dict.fromkeys(("MARKER", "UNIVERSAL_MARKER", "UNIVERSAL_SUFFIX", "CheckpointInfo", "UniversalCheckpoint",
                     "convert_to_universal", "inspect_tag", "is_universal_dir", "latest_complete", "needs_universal",
                     "scan"), "tags"),
}

if TYPE_CHECKING:
    from .export import ExportResult, choose_tag, consolidated_state_dict, export_checkpoint
    from .tags import (MARKER, UNIVERSAL_MARKER, UNIVERSAL_SUFFIX, CheckpointInfo, UniversalCheckpoint,
                       convert_to_universal, inspect_tag, is_universal_dir, latest_complete, needs_universal, scan)

__getattr__ = lazy_names(__name__, _WHERE)

__all__ = ["CheckpointInfo", "inspect_tag", "scan", "latest_complete", "MARKER", "UNIVERSAL_MARKER",
           "UNIVERSAL_SUFFIX", "UniversalCheckpoint", "is_universal_dir", "needs_universal", "convert_to_universal",
           "ExportResult", "choose_tag", "consolidated_state_dict", "export_checkpoint"]
