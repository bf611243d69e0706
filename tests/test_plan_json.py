"""``orch plan --output json`` of a large plan (issue 18): the pieces it is written in make exactly
``json.dumps(plan, default=str)`` (orchestrator/face/cli/planjson.py), and the scan for secrets of a plan of
thousands of ranks finds a secret in any one rank, and in any kind of container (orchestrator/spec/secrets.py).
No timing here: bench/plan_scale.py."""

from __future__ import annotations

import collections
import dataclasses
import json
import types

import pytest

from orchestrator.face.cli.planjson import dumps_plan
from orchestrator.planning import PlanInputs, make_plan, resolve_pool
from orchestrator.spec import spec_from_dict
from orchestrator.spec.secrets import MASK, redact, secret_values


def _plan(tmp_path, nodes: int, **fields):
    (tmp_path / "train.py").write_text("")
    spec = spec_from_dict({"name": "big", "entrypoint": "train.py", "workdir": str(tmp_path), "provisioner": "ssh",
                           "metrics_port": 9100, "launcher": "pdsh", **fields}, tmp_path)
    inputs = PlanInputs(job_id="big-1", master_port=29500, run_dir="/runs/big/attempt-1", checkpoint_dir="/ck",
                        python="/usr/bin/python3")
    return make_plan(spec, resolve_pool(collections.OrderedDict((f"node{i:04d}", 8) for i in range(nodes))), inputs)


def test_a_large_plan_is_written_as_json_dumps_writes_it(tmp_path) -> None:
    plan = _plan(tmp_path, 64, env={"QUOTED": 'say "hi" \\ there', "WIDE": "d\u00e9j\u00e0 \u2603", "EMPTY": ""},
                 args=["--name", "caf\u00e9", "--tab\there"])
    whole = {**plan.to_dict(), "network": {"0": "eth0 (10.0.0.1)"}}
    assert dumps_plan(whole) == json.dumps(whole, default=str)
    assert json.loads(dumps_plan(whole))["nodes"][63]["ranks"][7]["env"]["WIDE"] == "d\u00e9j\u00e0 \u2603"


def test_the_shared_dict_of_a_plan_is_the_same_json_without_copies(tmp_path) -> None:
    plan = _plan(tmp_path, 5, env={"QUOTED": 'say "hi"', "WIDE": "d\u00e9j\u00e0"}, args=["--x", "1"])
    shared, copied = plan.to_dict(shared=True), plan.to_dict()
    assert dumps_plan(shared) == dumps_plan(copied) == json.dumps(copied, default=str)
    # (indented: orch plan's small plans)
    assert json.dumps(shared, indent=2, default=str) == json.dumps(copied, indent=2, default=str)
    rank = plan.nodes[4].ranks[7]
    assert shared["nodes"][4]["ranks"][7]["env"] is rank.env and shared["nodes"][4]["ranks"][7]["argv"] is rank.argv
    copied_rank = copied["nodes"][4]["ranks"][7]
    assert copied_rank["env"] is not rank.env and copied_rank["argv"] == list(rank.argv)
    frozen = dataclasses.replace(rank, env=types.MappingProxyType(dict(rank.env)))  # a mapping that is not a dict
    assert frozen.to_dict(shared=True)["env"] == dict(rank.env) and type(frozen.to_dict(shared=True)["env"]) is dict


def test_ranks_and_nodes_of_other_shapes_are_written_as_json_dumps_writes_them(tmp_path) -> None:
    whole = _plan(tmp_path, 3).to_dict()
    nodes = whole["nodes"]
    ranks = nodes[0]["ranks"]
    ranks[0]["env"]["COUNT"] = 3                       # a value that is not a string
    ranks[1]["env"][7] = "seven"                       # a name that is not a string
    ranks[2]["argv"].append(["nested"])                # an argv word that is not a string (nor hashable)
    ranks[3]["extra"] = {"x": 1.5}                     # a key RankPlan.to_dict does not write
    ranks[4]["local_rank"] = True                      # a bool, which json writes as true
    ranks[5] = {k: ranks[5][k] for k in reversed(list(ranks[5]))}  # the same keys in another order
    ranks[6]["env"]["OBJ"] = types.SimpleNamespace(a=1)  # default=str's case
    nodes[1]["ranks"] = "none"                         # ranks that are not a list
    del nodes[2]["ranks"]
    whole["nodes"] = nodes + [{"ranks": []}, 5]
    assert dumps_plan(whole) == json.dumps(whole, default=str)
    assert dumps_plan({"no": "nodes"}) == json.dumps({"no": "nodes"})


def test_a_secret_in_one_rank_of_4096_nodes_is_found_and_masked(tmp_path) -> None:
    plan = _plan(tmp_path, 4096)
    assert redact(plan) is plan  # nothing to mask: not copied
    node = plan.nodes[2345]
    rank = dataclasses.replace(node.ranks[5], env={**node.ranks[5].env, "HF_TOKEN": "hf_0123456789abc"})
    nodes = list(plan.nodes)
    nodes[2345] = dataclasses.replace(node, ranks=node.ranks[:5] + (rank,) + node.ranks[6:])
    leaky = dataclasses.replace(plan, nodes=tuple(nodes))
    assert secret_values(leaky) == {"hf_0123456789abc"}
    shown = redact(leaky)
    assert shown.nodes[2345].ranks[5].env["HF_TOKEN"] == MASK
    assert "hf_0123456789abc" not in json.dumps(shown.to_dict())


def test_secrets_are_found_in_every_kind_of_container() -> None:
    @dataclasses.dataclass(eq=False)  # (hashed by identity: one can be in a set)
    class Holder:
        env: object
        env_from_file: object = None  # where a variable's value is read from: never a secret value

    point = collections.namedtuple("point", "a b")
    found = {
        "a dict in a list in a tuple": ([{"A_TOKEN": "v1"}],),
        "a mapping proxy": types.MappingProxyType({"B_KEY": "v2"}),
        "a namedtuple": point(1, {"C_SECRET": "v3"}),
        "a frozen set of tuples": frozenset({("x", (Holder({"D_PASSWORD": "v4"}),))}),
        "an ordered dict": collections.OrderedDict(E_CREDENTIAL="v5"),
        "a dataclass": Holder({"F_TOKEN": "v6"}),
        "by pattern": {"MY_DB_PASS": "v7"},
    }
    for what, obj in found.items():
        assert secret_values([1, "x", obj], ["MY_DB_*"]), what
    assert secret_values(found, ["MY_DB_*"]) == {f"v{i}" for i in range(1, 8)}
    assert secret_values({"G_TOKEN": "", "lower_token": "v8", "H_TOKEN": 5}) == set()  # empty, not a name, not text
    assert secret_values(Holder({}, {"I_TOKEN": "/run/secrets/i"})) == set()
    assert secret_values({"env_from_file": {"J_TOKEN": "/run/secrets/j"}}) == set()


def test_columns_of_equal_values_written_differently_are_written_as_json_dumps_writes_them(tmp_path) -> None:
    """The table writer (planjson's docstring) writes a column once only where its values are written alike:
    1 == 1.0 == True and 0.0 == -0.0, but json writes each its own way."""
    whole = _plan(tmp_path, 20, env={"PCT": "100% %s %%"}).to_dict(shared=True)
    nodes = whole["nodes"]
    odd = [1, 1.0, True, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), None, "1", (1, "a"), [], {}, 2 ** 70]
    for i, node in enumerate(nodes):
        node["odd"] = odd[i % len(odd)]
        node["same"] = {"a": [1, 2.5, "%"], "b": ()}
        node["ranks"][i % 8]["env"]["RANK"] = int(node["ranks"][i % 8]["env"]["RANK"])
    nodes[3]["ranks"][2]["argv"] = ("python", 1, None, False)
    nodes[4]["ranks"] = nodes[4]["ranks"][:3]
    assert dumps_plan(whole) == json.dumps(whole, default=str)
    nodes[5]["loop"] = whole  # a circular reference is refused as json.dumps refuses it
    with pytest.raises(ValueError, match="[Cc]ircular"):
        dumps_plan(whole)
