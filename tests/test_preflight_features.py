"""Preflight of what a DeepSpeed config's features need on each node (agents/preflight_features.py): ZeRO++
quantisation refused where the ranks' accelerator is cpu (DeepSpeed has no CPU kernels for it), and NVMe offload's
libaio (DeepSpeed's own AsyncIOBuilder.is_compatible in the ranks' Python, with the node's environment) and
nvme_path (exists or can be created, writable, free space), each failure naming the node, through the real
``orch run`` with local agents.

The libaio-missing node is real, not a mock: its ranks' ``LDFLAGS=-Wl,-Bstatic`` (spec ``node_env``) makes the
linker want a static libaio, which libaio-dev does not ship, so DeepSpeed's own io_submit link test fails on that
node only, as it does on a node without libaio-dev.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import helpers_train
from agents import preflight_features
from orchestrator.store import Store
from test_preflight import TWO_NODES, _events, _fields, _plan, _run_failing

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed, pytest.mark.async_io]

ROOT = Path(__file__).resolve().parent.parent
ZEROPP = json.loads((ROOT / "examples" / "ds_zeropp.json").read_text())
NO_CPU_KERNELS = "DeepSpeed has no CPU kernels for ZeRO++ quantized weights/gradients"
HOSTS = ["node-0", "node-1"]


def _build_async_io() -> None:
    """DeepSpeed's async_io op built (or loaded) once in the tests' TORCH_EXTENSIONS_DIR, as helpers_train.prebuild_ops
    does for the comm op (minutes of build on 2 cores; the session starts it in the background): the ops check of a
    node with libaio then finds it built."""
    helpers_train.prebuild_ops(async_io=True)


def _nvme_config(optimizer_path: Path, param_path: Path) -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(optimizer_path)},
                                  "offload_param": {"device": "nvme", "nvme_path": str(param_path)}}}


def test_which_feature_checks_apply(tmp_path) -> None:
    from orchestrator.supervision.preflight import PreflightRound, skipped_checks
    spec, plan = _plan(tmp_path, 2, deepspeed_config={"train_micro_batch_size_per_gpu": 1})
    skip = skipped_checks(spec, plan)
    assert "ZeRO++" in skip["zero_pp"] and "NVMe" in skip["nvme"]
    hpz_only = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}}
    assert "zero_pp" in skipped_checks(*_plan(tmp_path, 2, deepspeed_config=hpz_only))
    spec, plan = _plan(tmp_path, 2, deepspeed_config={**ZEROPP, "zero_optimization": {
        **ZEROPP["zero_optimization"], "zero_hpz_partition_size": 1}})
    assert "zero_pp" not in skipped_checks(spec, plan)
    spec, plan = _plan(tmp_path, 2, deepspeed_config=_nvme_config(tmp_path / "o", tmp_path / "p"),
                       preflight={"nvme_min_free_gb": 5})
    msg = PreflightRound(spec, plan, "python", timeout_s=60, heartbeat_s=0.5, lease_s=15).requests()[0]
    assert msg["nvme"] == {"paths": [("offload_optimizer", str(tmp_path / "o")), ("offload_param", str(tmp_path / "p"))],
                           "min_free_gb": 5.0}
    assert msg["zero_pp"] == [] and spec.preflight.nvme_min_free_gb == 5.0


def test_free_space_below_the_minimum_is_said_with_what_is_free(tmp_path) -> None:
    ok, sentence = preflight_features._path(str(tmp_path / "swap"), 1 << 60)  # 1 EiB: more than any disk here
    assert not ok and sentence.startswith(f"nvme_path {tmp_path / 'swap'} has ") and " GiB free, less than " \
        "preflight.nvme_min_free_gb (1.07374e+09 GiB)" in sentence
    ok, sentence = preflight_features._path(str(tmp_path / "swap"), 0)
    assert ok and sentence.startswith(f"nvme_path {tmp_path / 'swap'} is writable, ") and sentence.endswith("GiB free")
    # a relative nvme_path is the ranks' (from their workdir), not the agent's
    result = preflight_features.nvme([("offload_param", "rel-swap")], 0, None, {}, 5, workdir=str(tmp_path))
    assert (tmp_path / "rel-swap").is_dir() and f"nvme_path {tmp_path / 'rel-swap'} is writable" in result["detail"]
    assert result["status"] == "failed" and result["libaio"] is None  # no probe: libaio not known is not a pass


def test_zero_pp_quantisation_is_refused_on_cpu_naming_each_node(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()  # the ops check finds the comm op built
    config = {**ZEROPP, "zero_optimization": {**ZEROPP["zero_optimization"], "zero_hpz_partition_size": 1}}
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=config,
                                env={"DS_ACCELERATOR": "cpu"}))
    why = [f"the ranks' DeepSpeed accelerator here is cpu, and {NO_CPU_KERNELS} (zero_quantized_weights, "
           "zero_quantized_gradients: its QuantizerBuilder op is CUDA only", "This op had not been implemented on "
           "CPU backend", "remove these options"]
    cause = _run_failing(orch, spec, {h: {"zero_pp": why} for h in HOSTS}, HOSTS)
    assert cause["lines"][0].startswith("node-0, node-1 (nodes 0, 1): the ranks' DeepSpeed accelerator here is cpu")


def test_nvme_path_that_cannot_be_created_or_written_is_named(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    ro = tmp_path / "ro-nvme"
    ro.mkdir()
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=_nvme_config(afile / "swap", ro)))
    # a read-only tmpfs over one nvme_path, in a mount namespace of orch run's own (root ignores modes)
    mount = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o ro orch-test-ro {ro} && exec "$@"', "sh"]
    why = [f"nvme_path {afile / 'swap'} cannot be created: Not a directory (offload_optimizer)",
           f"nvme_path {ro} is not writable: Read-only file system (offload_param)"]
    _run_failing(orch, spec, {h: {"nvme": why} for h in HOSTS}, HOSTS, argv_prefix=mount)


def test_nvme_offload_passes_preflight_with_libaio(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()
    _build_async_io()
    swap = tmp_path / "nvme"
    config = _nvme_config(swap, swap)
    r = orch("run", str(write_spec(**_fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=config))), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (job,) = orch.json("list")
    (event,) = _events(Store(orch.state_dir / "orch.db"), job["id"], "preflight")
    checks = {(n["host"], c["name"]): c for n in event["nodes"] for c in n["checks"]}
    for host in HOSTS:
        nvme = checks[(host, "nvme")]
        assert nvme["status"] == "passed", nvme
        assert nvme["detail"].startswith(f"nvme_path {swap} is writable, ") and nvme["detail"].endswith(
            "GiB free (offload_optimizer); libaio: DeepSpeed's async_io op is compatible"), nvme
        ops = {o["name"]: o["status"] for o in checks[(host, "ops")]["ops"]}
        assert ops["async_io"] == "cached", checks[(host, "ops")]
    assert os.listdir(swap) == []  # the write probe is gone



def test_a_node_whose_libaio_link_fails_is_named(orch, write_spec, hostfile, tmp_path) -> None:
    helpers_train.prebuild_ops()
    _build_async_io()  # node-0 has libaio: its ops check loads the op
    swap = tmp_path / "nvme"
    # node-1's ranks link statically (LDFLAGS, node_env): DeepSpeed's io_submit link test fails there only
    spec = write_spec(**_fields(hostfile(TWO_NODES), tmp_path, deepspeed_config=_nvme_config(swap, swap),
                                node_env={"node-1": {"LDFLAGS": "-Wl,-Bstatic"}}))
    why = ["DeepSpeed's async_io op, which NVMe offload swaps through, is not compatible here: a test program calling "
           "io_submit does not compile and link with -laio (AsyncIOBuilder.is_compatible, with the ranks' "
           "LDFLAGS='-Wl,-Bstatic'). Install libaio-dev (Debian/Ubuntu) or libaio-devel (RHEL/Fedora)",
           f"nvme_path {swap} is writable"]
    cause = _run_failing(orch, spec, {"node-1": {"nvme": why}}, HOSTS)
    assert cause["lines"] == [f"node-1 (node 1): {cause['failures'][0]['message']}"]
    (job,) = orch.json("list")
    (event,) = _events(Store(orch.state_dir / "orch.db"), job["id"], "preflight")
    checks = {(n["host"], c["name"]): c for n in event["nodes"] for c in n["checks"]}
    assert checks[("node-0", "nvme")]["status"] == "passed"
    # node-1 does not try to build the op it cannot link; the nvme check says why
    assert "async_io not built: libaio is missing (the nvme check)" in checks[("node-1", "ops")]["detail"]
    assert "async_io" not in {o["name"] for o in checks[("node-1", "ops")]["ops"]}
