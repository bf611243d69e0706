"""``orch export``: a job's checkpoint as one consolidated fp32 state_dict file."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console

from .backends import pick_backend
from .output import UsageError, console, human_bytes, print_json



def cmd_export(args: argparse.Namespace) -> int:
    from ...checkpoints import export_checkpoint
    from ...errors import ExportError
    if not args.file:
        raise UsageError("Name the file to write: orch export JOB model.pt (or orch export JOB --output model.pt).")
    detail = pick_backend(args).detail(args.job)
    if not detail.get("checkpoint_dir"):
        raise ExportError(f"Job {detail['id']} never started an attempt, so it has no checkpoints to export.")
    # bound to the real stderr now: the export sends DeepSpeed's own output elsewhere while it runs
    err = Console(file=sys.stderr, width=None if sys.stderr.isatty() else 200, markup=False)
    ckpt, label = detail["checkpoint_dir"], f"Job {detail['id']}"
    if err.is_terminal:
        with err.status("Exporting...") as status:
            result = export_checkpoint(ckpt, args.file, args.tag, label=label,
                                       progress=lambda msg: status.update(msg + "..."))
    else:
        result = export_checkpoint(ckpt, args.file, args.tag, label=label, progress=lambda msg: err.print(
            f"[{time.strftime('%H:%M:%S')}] {msg}", markup=False, highlight=False))
    if args.output == "json":
        print_json({"job": detail["id"], **result.to_dict()})
        return 0
    c = console
    c.print(f"Exported checkpoint {result.tag} of job {detail['id']} (step {result.step}, ZeRO stage "
            f"{result.zero_stage}, {result.world_size} ranks) to {result.output}", markup=False, highlight=False)
    c.print(f"  {result.tensors} tensors, {result.params:,} parameters, {'/'.join(result.dtypes)}, "
            f"{human_bytes(result.bytes)}, {result.seconds:.1f} s ({result.method})", markup=False, highlight=False)
    c.print(f"  load it with: model.load_state_dict(torch.load({result.output!r}, weights_only=True))",
            markup=False, highlight=False, soft_wrap=True)
    return 0
