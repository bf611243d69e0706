"""One finished ZeRO training job per stage, trained once per pytest session and shared (a pytest plugin).

The fixture ``zero_run`` (session scope) is a factory: ``zero_run(stage)`` returns the :class:`ZeroRun` of
that stage's job, running it (one ``orch run``, about a minute on 2 cores) the first time any test of the
session asks for it and handing every later caller the same finished run. ``stage`` is one of
:data:`STAGES`: 0, 1, 2, 3 or ``"2_offload"``.

The job of each stage (:func:`zero_spec`): examples/train_gpt.py with a tiny model (:data:`TINY`) under
``orch run`` on 2 local "nodes" (launcher pdsh, a state dir of its own), :func:`slots` per node (2 at
stage 2, else 1: world size 4 at stage 2, else 2), DeepSpeed config examples/ds_zero<stage>.json with
``train_micro_batch_size_per_gpu`` 4, :data:`STEPS` (60) steps and a checkpoint every :data:`INTERVAL`
(10): complete tags ``step_10`` ... ``step_60`` (every rank's DeepSpeed files, orch's per-rank files and
marker), and after the last step DeepSpeed's consolidated model ``step_60/pytorch_model.bin``
(``engine.save_16bit_model``; fp32 as training is): at stages 0-2 and 2_offload asked for with
``--save-16bit-model``, at stage 3 by the config's ``stage3_gather_16bit_weights_on_model_save`` alone.

What a test may do with a run: read it. ``orch status``/``list``/``logs`` of its job, ``orch export``
of its checkpoints to a file of the test's own, load or inspect any of its files, run another job of
the same spec in a state dir of its own (:func:`zero_spec`: the kill-and-resume test does).

What a test may not do with it: write, remove, rename or add anything under the run's directory (the
state dir, the job's run and checkpoint directories), nor resume, gc or otherwise change its job: every
later test of the session sees the same files. A test that needs changed files (a damaged shard, an extra
tag, a marker removed) works on a copy: :meth:`ZeroRun.copy` (the whole job, state dir included, for
``orch`` commands on the copy) or ``shutil.copytree(run.ckpt, tmp_path / ...)`` (the checkpoints alone).
Every hand-out of a run, and the session's end, checks that its checkpoint and run directories still
hold the files the job left (names, sizes, modification times) and fails naming what changed.

The ``orch run`` is not asserted here: :attr:`ZeroRun.result` is its CompletedProcess and each test
asserts what it needs of it (tests/test_training.py checks the whole job).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from conftest import ROOT, Orch, assert_no_leftovers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers_train  # noqa: E402

EXAMPLES = ROOT / "examples"
#: the ZeRO stages there is a shared run of
STAGES = (0, 1, 2, 3, "2_offload")
#: the model and corpus: 1 layer, d_model 32, 2 heads, 32-byte windows of 200 kB of the standard library
TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--corpus-bytes", "200000",
        "--log-interval", "0"]
MODEL = {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 32, "dropout": 0.1}  # TINY, as ByteGPT's arguments
#: every stage's job: STEPS steps, a checkpoint every INTERVAL
STEPS, INTERVAL = 60, 10
MICRO_BATCH = 4
NODES = 2


def slots(stage: int | str) -> int:
    """Slots per node of the stage's job: 2 at ZeRO-2, else 1."""
    return 2 if stage == 2 else 1


def zero_stage(stage: int | str) -> int:
    """The ZeRO stage DeepSpeed runs (``"2_offload"`` is stage 2 with the optimizer on the CPU)."""
    return 2 if stage == "2_offload" else int(stage)


def zero_spec(stage: int | str, directory: Path, name: str = "zero") -> Path:
    """Write the stage's job (the module docstring) as ``<directory>/<name>.yaml`` with its hostfile
    ``<directory>/<name>.hostfile``; returns the spec's path. ``name`` is the job's name, nothing else."""
    config = json.loads((EXAMPLES / f"ds_zero{stage}.json").read_text())
    config["train_micro_batch_size_per_gpu"] = MICRO_BATCH
    args = [*TINY, "--steps", str(STEPS), "--checkpoint-interval", str(INTERVAL)]
    if stage == 3:  # the config flag alone turns the consolidated model on (ZeRO-3 gathers it only then)
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    else:
        args.append("--save-16bit-model")
    hostfile = directory / f"{name}.hostfile"
    hostfile.write_text("".join(f"node-{i} slots={slots(stage)}\n" for i in range(NODES)))
    spec = directory / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "hostfile": str(hostfile), "launcher": "pdsh", "workdir": str(EXAMPLES),
        "entrypoint": "train_gpt.py", "args": args, "deepspeed_config": config, "stop_grace_seconds": 5,
        "env": {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}}, sort_keys=False))
    return spec


def spec_fields(spec: Path) -> dict[str, Any]:
    """What a spec written by :func:`zero_spec` runs: its fields without the name, the hostfile's text in
    place of its path (two specs with equal ``spec_fields`` are the same job)."""
    fields = yaml.safe_load(spec.read_text())
    fields.pop("name")
    fields["hostfile"] = Path(fields["hostfile"]).read_text()
    return fields


def _left(job_id: str, timeout: float) -> list[str]:
    """What ``assert_no_leftovers(job_id, timeout)`` fails with now, if it does."""
    try:
        assert_no_leftovers(job_id, timeout=timeout)
    except AssertionError as err:
        return [str(err)]
    return []


def _snapshot(*dirs: Path) -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime_ns)}`` of every file and directory under ``dirs``."""
    found = {}
    for d in dirs:
        for p in [d, *d.rglob("*")]:
            st = p.lstat()
            found[str(p)] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return found


def _changes(before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> list[str]:
    said = [f"added {p}" for p in sorted(set(now) - set(before))]
    said += [f"removed {p}" for p in sorted(set(before) - set(now))]
    said += [f"changed {p}" for p in sorted(set(now) & set(before)) if now[p] != before[p]]
    return said


@dataclass(eq=False)
class ZeroRun:
    """One finished ``orch run`` of a stage's job (:func:`zero_spec`) in a state dir of its own.

    ``root`` holds ``state/`` (the state dir), the spec ``zero.yaml`` and its hostfile. ``result`` is
    ``orch run``'s CompletedProcess, ``job_id`` the job's id (None if none was created), ``leftovers``
    what ``assert_no_leftovers(job_id, 1)`` failed with 1 s after ``orch run`` returned ([]: nothing)."""

    stage: int | str
    root: Path
    result: subprocess.CompletedProcess
    job_id: str | None
    leftovers: list[str]
    copied_from: Path | None = None
    snapshot: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def orch(self) -> Orch:
        return Orch(self.root / "state")

    @property
    def spec(self) -> Path:
        return self.root / "zero.yaml"

    @property
    def slots(self) -> int:
        return slots(self.stage)

    @property
    def world(self) -> int:
        return NODES * self.slots

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.stage)

    @cached_property
    def detail(self) -> dict:
        """``orch status JOB`` as JSON, once."""
        return self.orch.json("status", self.job_id)

    @property
    def ckpt(self) -> Path:
        """The job's checkpoint directory (``step_10`` ... ``step_60``)."""
        return Path(self.detail["checkpoint_dir"])

    @property
    def run_dir(self) -> Path:
        """The job's (only) attempt's run directory (``logs/rank-<r>.log``)."""
        return Path(self.detail["run_dir"])

    def copy(self, dest: Path) -> "ZeroRun":
        """The whole run (state dir, spec, the job's run and checkpoint directories) copied to ``dest`` (which
        must not exist), its store's paths pointed at the copy: ``orch`` commands on the copy's job read and
        change the copy's files only. For a test that changes checkpoint files."""
        shutil.copytree(self.root, dest, symlinks=True)
        old, new = str(self.root) + "/", str(dest) + "/"
        db = sqlite3.connect(dest / "state" / "orch.db")
        try:
            with db:
                for table, column in (("jobs", "spec"), ("attempts", "plan"), ("events", "data")):
                    db.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?)", (old, new))
        finally:
            db.close()
        copied = ZeroRun(self.stage, dest, self.result, self.job_id, self.leftovers, copied_from=self.root)
        assert copied.ckpt == dest / self.ckpt.relative_to(self.root) and copied.ckpt.is_dir(), copied.ckpt
        return copied

    def check_unchanged(self) -> None:
        """Fail if a file under the job's checkpoint or run directory was added, removed or changed since
        the job ended (a test changed the shared run instead of a copy)."""
        if not self.snapshot:
            return
        said = _changes(self.snapshot, _snapshot(self.ckpt, self.run_dir))
        if said:
            raise AssertionError(f"the shared ZeRO-{self.stage} run (tests/zero_runs.py) was changed by a test; "
                                 f"copy it first (ZeroRun.copy or shutil.copytree into tmp_path): "
                                 + "; ".join(said[:10]) + (f" (and {len(said) - 10} more)" if len(said) > 10 else ""))


def _train(stage: int | str, root: Path) -> ZeroRun:
    (root / "state").mkdir()
    spec = zero_spec(stage, root)
    orch = Orch(root / "state")
    r = orch("run", str(spec))
    jobs = orch.json("list")
    job_id = jobs[0]["id"] if jobs else None
    run = ZeroRun(stage, root, r, job_id, _left(job_id, 1) if job_id else [])
    if job_id and orch.json("status", job_id).get("checkpoint_dir"):
        run.snapshot = _snapshot(run.ckpt, run.run_dir)
    return run


@pytest.fixture(scope="session")
def zero_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int | str], ZeroRun]:
    """``zero_run(stage)``: the session's one finished run of the stage's job (module docstring), trained on
    first use. Read it; copy it (:meth:`ZeroRun.copy`) to change it."""
    runs: dict[int | str, ZeroRun] = {}

    def get(stage: int | str) -> ZeroRun:
        assert stage in STAGES, f"no shared run of stage {stage!r}: one of {STAGES}"
        if stage not in runs:
            helpers_train.prebuild_ops()  # DeepSpeed's CPU ops built or loaded once, not in every rank at once
            runs[stage] = _train(stage, tmp_path_factory.mktemp(f"zero_run_{stage}"))
        else:
            runs[stage].check_unchanged()
        return runs[stage]

    yield get
    for run in runs.values():
        run.check_unchanged()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test using ``zero_run`` starts DeepSpeed jobs: marked ``integration`` and ``deepspeed``."""
    for item in items:
        if "zero_run" in getattr(item, "fixturenames", ()):
            item.add_marker("integration")
            item.add_marker("deepspeed")
