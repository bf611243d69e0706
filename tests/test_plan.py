"""The pure planner: rank numbering, environment layering, orch's variables, errors."""

from __future__ import annotations

import collections

import pytest
from conftest import HF_DS

from orchestrator.errors import LaunchError, PlanError, SpecError
from orchestrator.planning import PlanInputs, ResourcePool, make_plan, resolve_pool
from orchestrator.spec import spec_from_dict


def _spec(tmp_path, **fields):
    (tmp_path / "train.py").write_text("")
    base = {"name": "p", "entrypoint": "train.py", "workdir": str(tmp_path)}
    base.update(fields)
    return spec_from_dict(base, tmp_path)


def _inputs(**kw) -> PlanInputs:
    base = dict(job_id="p-abc123", master_port=29555, run_dir="/runs/p/attempt-1", checkpoint_dir="/ck",
                python="/usr/bin/python3", controller_env={"PYTHONPATH": "/site", "HOME": "/root"},
                controller_cwd="/work")
    base.update(kw)
    return PlanInputs(**base)


def _pool(*hosts: tuple[str, int], **filters) -> ResourcePool:
    return resolve_pool(collections.OrderedDict(hosts), **filters)


def test_ranks_are_numbered_node_by_node_in_hostfile_order(tmp_path) -> None:
    plan = make_plan(_spec(tmp_path), _pool(("b", 2), ("a", 3), include="b:1@a:0,2"), _inputs())
    assert [(n.node_rank, n.host, n.slots) for n in plan.nodes] == [(0, "b", (1,)), (1, "a", (0, 2))]
    # DeepSpeed's launch.py: LOCAL_RANK = RANK % ranks on the node, and the slot is slots[LOCAL_RANK]
    assert [(n.host, r.global_rank, r.local_rank, r.slot, r.env["RANK"]) for n, r in plan.ranks()] == [
        ("b", 0, 0, 1, "0"), ("a", 1, 1, 2, "1"), ("a", 2, 0, 0, "2")]
    assert plan.world_size == 3 and plan.master_addr == "127.0.0.1" and plan.master_port == 29555


def test_environment_layers_and_orch_variables(tmp_path) -> None:
    spec = _spec(tmp_path, env={"RANK": "99", "PYTHONPATH": "/mine", "X": "a $b"}, deepspeed_config={"a": 1})
    plan = make_plan(spec, _pool(("n0", 1), ("n1", 1)), _inputs(resume_tag="step_20", attempt=3))
    env = plan.nodes[1].ranks[0].env
    assert env["RANK"] == "1"  # the launcher's own variables win over the spec's env
    assert env["PYTHONPATH"] == "/mine" and env["X"] == "a $b"  # the spec's env wins over pdsh's exports
    assert env["ORCH_JOB_ID"] == "p-abc123" and env["ORCH_ATTEMPT"] == "3" and env["ORCH_RESTART_COUNT"] == "2"
    assert env["ORCH_ATTEMPT_ID"] == "p-abc123.3" and env["ORCH_NODE"] == "n1" and env["ORCH_NODE_RANK"] == "1"
    assert env["ORCH_RESUME_TAG"] == "step_20" and env["ORCH_CHECKPOINT_DIR"] == "/ck"
    assert env["ORCH_DEEPSPEED_CONFIG"] == "/runs/p/attempt-1/ds_config.json"
    # what the real pdsh would export includes the spec's env (and warns about the '$')
    (real,) = plan.real_commands
    assert "export X=\"a $b\"; " in " ".join(real.argv)
    assert any("'a $b'" in w and "orch passes it exactly" in w for w in plan.warnings)


def test_no_resume_tag_means_no_variable(tmp_path) -> None:
    plan = make_plan(_spec(tmp_path), _pool(("n0", 1)), _inputs())
    env = plan.nodes[0].ranks[0].env
    assert "ORCH_RESUME_TAG" not in env and "ORCH_DEEPSPEED_CONFIG" not in env


def test_deepspeed_args_appends_the_config_path(tmp_path) -> None:
    spec = _spec(tmp_path, args=["--x", "1"], deepspeed_config={"a": 1}, deepspeed_args=True)
    argv = make_plan(spec, _pool(("n0", 1)), _inputs()).nodes[0].ranks[0].argv
    assert list(argv[-5:]) == ["--x", "1", "--deepspeed", "--deepspeed_config", "/runs/p/attempt-1/ds_config.json"]
    assert argv[2:4] == (str(tmp_path / "train.py"), "--local_rank=0")


def test_standard_launcher_asks_node_0_to_host_the_store(tmp_path) -> None:
    plan = make_plan(_spec(tmp_path, launcher="standard"), _pool(("n0", 2), ("n1", 2)), _inputs())
    assert plan.nodes[0].agent_store == {"addr": "127.0.0.1", "port": 29555}
    assert plan.nodes[1].agent_store is None
    assert plan.nodes[1].ranks[1].env["TORCHELASTIC_RUN_ID"] == "p-abc123"


def test_pool_problems_are_plan_errors(tmp_path) -> None:
    with pytest.raises(PlanError, match="n1 have no slots"):
        make_plan(_spec(tmp_path), _pool(("n0", 1), ("n1", 0)), _inputs())
    with pytest.raises(PlanError, match="No slots are left"):
        make_plan(_spec(tmp_path), ResourcePool(nodes=()), _inputs())


def test_settings_that_do_nothing_are_named(tmp_path) -> None:
    two = _pool(("n0", 1), ("n1", 1))
    plan = make_plan(_spec(tmp_path).model_copy(update={"launcher": "standard", "launcher_args": ["-x"]}), two, _inputs())
    assert any("launcher_args are not used (the standard launcher has no real tool" in w for w in plan.warnings)
    one = make_plan(_spec(tmp_path).model_copy(update={"launcher": "openmpi", "launcher_args": ["-v"]}),
                    _pool(("n0", 2)), _inputs())
    assert any("launcher_args are not used (one node" in w for w in one.warnings)
    spec = _spec(tmp_path, launcher="openmpi", native_start_timeout=5)
    assert any("native_start_timeout applies only" in w for w in make_plan(spec, two, _inputs()).warnings)
    native = make_plan(spec.model_copy(update={"launch_mode": "native"}), two, _inputs())
    assert any("provisioner local: the real tool reaches" in w for w in native.warnings)
    assert any("keeps DeepSpeed's --mca btl_tcp_if_include eth0" in w for w in native.warnings)


def test_native_mode_needs_a_launcher_that_has_one(tmp_path) -> None:
    spec = _spec(tmp_path).model_copy(update={"launch_mode": "native"})  # pdsh
    with pytest.raises(LaunchError, match="the pdsh launcher has no native mode"):
        make_plan(spec, _pool(("n0", 1), ("n1", 1)), _inputs())
    native = make_plan(spec.model_copy(update={"launcher": "openmpi"}), _pool(("n0", 1), ("n1", 1)), _inputs())
    first, second = (n.native for n in native.nodes)
    assert first["command"]["argv"][0] == first["command"]["tools"][0] == "mpirun.openmpi"
    assert first["command"]["family"] == "openmpi"
    assert first["command"]["shim_token"] in first["command"]["argv"] and second["command"] is None
    assert first["world_size"] == 2 and first["start_timeout"] == 120.0
    assert make_plan(spec.model_copy(update={"launch_mode": "emulated"}), _pool(("n0", 1)), _inputs()).nodes[0].native is None


def test_plan_round_trips_through_json(tmp_path) -> None:
    import json
    plan = make_plan(_spec(tmp_path), _pool(("n0", 2), ("n1", 2)), _inputs())
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["nodes"][1]["ranks"][1]["env"]["RANK"] == "3" and d["world_size"] == 4
    assert d["nodes"][0]["env_defaults"] == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def test_metrics_ports_per_node(tmp_path) -> None:
    local = make_plan(_spec(tmp_path, metrics_port=9100), _pool(("n0", 1), ("n1", 1), ("n2", 1)), _inputs())
    assert [n.metrics_port for n in local.nodes] == [9100, 9101, 9102]  # one machine: one port each
    ssh = _spec(tmp_path, metrics_port=9100).model_copy(update={"provisioner": "ssh"})
    remote = make_plan(ssh, _pool(("n0", 1), ("n1", 1)), _inputs())
    assert [n.metrics_port for n in remote.nodes] == [9100, 9100]  # their own hosts
    assert make_plan(_spec(tmp_path), _pool(("n0", 1)), _inputs()).nodes[0].metrics_port == 0  # auto: any free
    assert make_plan(_spec(tmp_path, metrics_port=None), _pool(("n0", 1)), _inputs()).nodes[0].metrics_port is None


def test_deepspeed_csv_monitor_is_turned_on_into_the_attempts_scratch_dir(tmp_path) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    plan = make_plan(_spec(tmp_path), _pool(("n0", 2), ("n1", 2)), _inputs(deepspeed_config=ds))
    metrics_dir = plan.run_dir + "/scratch"
    assert plan.deepspeed_config == {**ds, "csv_monitor": {"enabled": True, "output_path": metrics_dir + "/deepspeed",
                                                           "job_name": "rank0"}}
    assert [n.metrics_dir for n in plan.nodes] == [metrics_dir] * 2
    assert [n.deepspeed_monitor_dir for n in plan.nodes] == [metrics_dir + "/deepspeed/rank0", None]  # rank 0's node
    own = {**ds, "csv_monitor": {"enabled": True, "output_path": "/data/mon", "job_name": "exp"}}
    plan = make_plan(_spec(tmp_path), _pool(("n0", 1)), _inputs(deepspeed_config=own))
    assert plan.deepspeed_config == own and plan.nodes[0].deepspeed_monitor_dir == "/data/mon/exp"
    off = {**ds, "csv_monitor": {"enabled": False}}
    plan = make_plan(_spec(tmp_path), _pool(("n0", 1)), _inputs(deepspeed_config=off))
    assert plan.deepspeed_config == off and plan.nodes[0].deepspeed_monitor_dir is None
    assert make_plan(_spec(tmp_path), _pool(("n0", 1)), _inputs()).nodes[0].deepspeed_monitor_dir is None
    with pytest.raises(PlanError, match="at most 65534"):
        make_plan(_spec(tmp_path, metrics_port=65535), _pool(("n0", 1), ("n1", 1)), _inputs())


def test_restart_policy_reaches_the_ranks_and_its_rules(tmp_path) -> None:
    spec = _spec(tmp_path, launcher="standard", restart={"max_restarts": 4, "retry_exit_codes": [3, -9]})
    plan = make_plan(spec, _pool(("n0", 1)), _inputs(attempt=3))
    env = plan.nodes[0].ranks[0].env
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["ORCH_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "4"  # torchrun's --max_restarts
    policy = spec.restart
    assert [policy.backoff(k) for k in range(4)] == [5, 10, 20, 40]
    assert policy.retries({"kind": "rank_exit", "returncode": -9})
    assert not policy.retries({"kind": "rank_exit", "returncode": 1})
    assert policy.retries({"kind": "node_lost"}) and not policy.retries({"kind": "cancelled"})
    assert _spec(tmp_path, restart={"backoff_seconds": 100, "max_backoff_seconds": 150}).restart.backoff(3) == 150
    with pytest.raises(SpecError, match=r"restart\.retry_on\[0\]: Input should be 'rank_exit'"):
        _spec(tmp_path, restart={"retry_on": ["oom"]})


def test_every_node_knows_the_master_and_the_directory_to_put_first_on_path(tmp_path) -> None:
    plan = make_plan(_spec(tmp_path), _pool(("a", 1), ("b", 1)), _inputs(default_master_addr="10.0.0.1"))
    assert [n.master for n in plan.nodes] == [{"addr": "10.0.0.1", "port": 29555, "spans_hosts": False}] * 2
    assert [n.path_prepend for n in plan.nodes] == ["/usr/bin"] * 2  # the ranks' Python's directory
    assert plan.nodes[0].to_dict()["master"] == plan.nodes[0].master
    ssh = make_plan(_spec(tmp_path, provisioner="ssh"), _pool(("a", 1), ("b", 1)), _inputs())
    assert all(n.master["spans_hosts"] for n in ssh.nodes)  # other machines: loopback cannot work
    one = make_plan(_spec(tmp_path, provisioner="ssh"), _pool(("a", 2)), _inputs())
    assert not one.nodes[0].master["spans_hosts"]
    off = make_plan(_spec(tmp_path, prepend_python_bin=False), _pool(("a", 1)), _inputs())
    assert off.nodes[0].path_prepend is None
    bare = make_plan(_spec(tmp_path), _pool(("a", 1)), _inputs(python="python3"))  # not resolved: nothing to put
    assert bare.nodes[0].path_prepend is None


HF_TRAINER_SCRIPT = "from transformers import Trainer, TrainingArguments\n"
HF_LEFT = ["train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping",
           "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
           "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
           "scheduler.params.warmup_num_steps", "zero_optimization.reduce_bucket_size"]


def test_orch_plan_says_who_fills_the_deepspeed_configs_autos(tmp_path, orch, write_spec) -> None:
    import json
    (tmp_path / "hf_trainer.py").write_text(HF_TRAINER_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps(HF_DS))
    spec = write_spec(entrypoint="hf_trainer.py", deepspeed_config="ds.json", num_gpus=2,
                      args=["--deepspeed", "ds.json"])
    r = orch("plan", str(spec), check=True)
    line = ('deepspeed config: "auto" values filled by the script (detected: hf_trainer.py imports '
            f'transformers.Trainer); left auto: {", ".join(HF_LEFT)}')
    assert line in r.stdout.replace("\n", " ") or line in r.stdout
    plan = orch.json("plan", str(spec))
    assert plan["deepspeed_autos"] == {"filled_by": "script", "why": "detected: hf_trainer.py imports "
                                       "transformers.Trainer", "left_auto": HF_LEFT}
    assert plan["deepspeed_config"]["optimizer"]["params"]["lr"] == "auto"
    # told that orch fills them: refused, with today's message and what to set
    r = orch("plan", str(write_spec(entrypoint="hf_trainer.py", deepspeed_config="ds.json",
                                    deepspeed_config_filled_by="orch")))
    assert r.returncode == 2 and 'optimizer.params.betas: is "auto", but nothing fills this key' in r.stderr
    assert "deepspeed_config_filled_by: script" in r.stderr and "Traceback" not in r.stderr
    # a config without "auto": nothing to say
    (tmp_path / "plain.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    plain = orch.json("plan", str(write_spec(entrypoint="hf_trainer.py", deepspeed_config="plain.json")))
    assert plain["deepspeed_autos"] is None
    assert make_plan(_spec(tmp_path), _pool(("n0", 1)), _inputs()).to_dict()["deepspeed_autos"] is None


def test_each_exporter_listens_where_the_controller_reaches_its_node(tmp_path) -> None:
    addrs = {"n0": "10.0.0.1", "n1": "10.0.0.2"}
    plan = make_plan(_spec(tmp_path), _pool(("n0", 1), ("n1", 1)), _inputs(node_addresses=addrs))
    assert [n.metrics_addr for n in plan.nodes] == ["10.0.0.1", "10.0.0.2"]
    assert plan.nodes[1].to_dict()["metrics_addr"] == "10.0.0.2"
    every = make_plan(_spec(tmp_path, metrics_addr="0.0.0.0"), _pool(("n0", 1)), _inputs(node_addresses=addrs))
    assert every.nodes[0].metrics_addr == "0.0.0.0"
    with pytest.raises(SpecError, match="metrics_addr.*not an IP address"):
        _spec(tmp_path, metrics_addr="every")


def test_plan_offline_plans_hosts_this_machine_cannot_reach_and_says_what_it_skipped(orch, write_spec, hostfile) -> None:
    hosts = hostfile("gpu-a1.unresolvable.invalid slots=2\ngpu-a2.unresolvable.invalid slots=2\n")
    spec = write_spec(entrypoint="train.py", hostfile=str(hosts), provisioner="ssh",
                      ssh={"known_hosts": "/nonexistent/known_hosts"})
    (spec.parent / "train.py").write_text("print('hi')\n")
    r = orch("plan", str(spec))
    assert r.returncode == 2 and "gpu-a1.unresolvable.invalid does not resolve" in r.stderr
    r = orch("plan", str(spec), "--offline", "--output", "json")
    assert r.returncode == 0, r.stderr
    plan = __import__("json").loads(r.stdout)
    assert plan["master_addr"] == "gpu-a1.unresolvable.invalid" and plan["world_size"] == 4
    assert [n["host"] for n in plan["nodes"]] == ["gpu-a1.unresolvable.invalid", "gpu-a2.unresolvable.invalid"]
    assert any(w.startswith("offline: not checked: that each host's name resolves, that its host key is in "
                            "known_hosts") for w in plan["warnings"])
    r = orch("plan", "--offline", str(spec))  # before the spec too
    assert r.returncode == 0 and "offline: not checked" in " ".join((r.stdout + r.stderr).split())
