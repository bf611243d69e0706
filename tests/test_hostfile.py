"""orchestrator.planning.hostfile: error messages, warnings for DeepSpeed's quirks, examples, speed.

Equivalence with DeepSpeed itself is checked in tests/test_hostfile_differential.py.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import time
from pathlib import Path

import pytest

from orchestrator.errors import FilterError, HostfileError, OrchError
from orchestrator.planning import (
    Hostfile,
    ResourcePool,
    load_hostfile,
    parse_filter,
    parse_hostfile,
    resolve_pool,
)

REPO = Path(__file__).resolve().parent.parent
HOSTFILES = REPO / "hostfiles"


def write(tmp_path: Path, text: str, name: str = "hostfile") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def one_sentence(message: str) -> None:
    """A whole sentence: starts with a capital and ends with a period, on one line."""
    assert message[0].isupper() and message.endswith(".") and "\n" not in message, message


# --------------------------------------------------------------------------- hostfile errors


def test_bad_line_names_path_line_text_and_form(tmp_path):
    path = write(tmp_path, "# cluster\n10.0.0.1 slots=8\n10.0.0.2 lots=8\n")
    with pytest.raises(HostfileError) as info:
        load_hostfile(path)
    err = info.value
    msg = str(err)
    one_sentence(msg)
    assert path in msg and "Line 3" in msg and "'10.0.0.2 lots=8'" in msg
    assert "<host> slots=<n>" in msg and "'lots=8'" in msg
    assert (err.path, err.line_no, err.line) == (path, 3, "10.0.0.2 lots=8")


@pytest.mark.parametrize("line,hint", [
    ("worker-0", "no 'slots=<n>' field"),
    ("slots=8", "no host name"),
    ("worker-0 slots = 8", "without spaces"),
    ("worker-0 slots=", "nothing follows 'slots='"),
    ("worker-0 slots=-2", "non-negative whole number"),
    ("worker-0 SLOTS=8", "lower case"),
    ("worker-0 8", "'slots=8'"),
])
def test_bad_line_hints(line, hint):
    with pytest.raises(HostfileError, match=re.escape(hint)) as info:
        parse_hostfile(f"ok slots=1\n{line}\n", path="hf")
    assert info.value.line_no == 2 and info.value.line == line
    one_sentence(str(info.value))


def test_duplicate_host_names_both_lines():
    with pytest.raises(HostfileError) as info:
        parse_hostfile("w0 slots=2\n# spare\nw1 slots=2\n\nw0 slots=4\n", path="hf/dup")
    msg = str(info.value)
    one_sentence(msg)
    assert "hf/dup" in msg and "'w0'" in msg and "line 1" in msg and "line 5" in msg
    assert info.value.line_no == 5


def test_empty_hostfile_names_path(tmp_path):
    path = write(tmp_path, "# nothing here yet\n\n   \n\t# still nothing\n")
    with pytest.raises(HostfileError) as info:
        load_hostfile(path)
    one_sentence(str(info.value))
    assert path in str(info.value) and "<host> slots=<n>" in str(info.value)
    assert info.value.line_no is None


def test_missing_hostfile_is_a_hard_error(tmp_path):
    missing = tmp_path / "no-such-hostfile"
    with pytest.raises(HostfileError, match="does not exist") as info:
        load_hostfile(missing)
    assert str(missing) in str(info.value) and info.value.path == str(missing)
    one_sentence(str(info.value))


def test_directory_and_non_utf8_hostfiles(tmp_path):
    with pytest.raises(HostfileError, match="is a directory"):
        load_hostfile(tmp_path)
    bad = tmp_path / "latin1"
    bad.write_bytes("h\xf6st slots=1\n".encode("latin-1"))
    with pytest.raises(HostfileError, match="not UTF-8") as info:
        load_hostfile(bad)
    assert str(bad) in str(info.value)


@pytest.mark.integration
def test_unreadable_hostfile(tmp_path):
    path = Path(write(tmp_path, "w0 slots=1\n"))
    path.chmod(0)
    tmp_path.chmod(0o755)
    if os.geteuid() != 0:
        with pytest.raises(HostfileError, match="could not be read"):
            load_hostfile(path)
        return
    # root reads any file: check it as an unprivileged user, in a child process
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            load_hostfile(path)
            code = 1
        except HostfileError as err:
            code = 0 if "could not be read" in str(err) and str(path) in str(err) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_huge_slot_count_is_an_error_not_a_crash():
    with pytest.raises(HostfileError, match="too long"):
        parse_hostfile("w0 slots=" + "9" * 5000)
    hosts = parse_hostfile("w0 slots=99999999999\n")  # DeepSpeed parses this too ...
    with pytest.raises(HostfileError, match="more than"):
        resolve_pool(hosts)  # ... but would build a list of 10^11 slots


def test_hostfile_is_an_ordered_dict_with_line_numbers():
    hosts = parse_hostfile("b slots=1\r\n# c\r\na\tslots=2 # rack 1\r\n", path="hf")
    assert hosts == collections.OrderedDict([("b", 1), ("a", 2)])
    assert list(hosts) == ["b", "a"] and isinstance(hosts, Hostfile)
    assert isinstance(hosts, collections.OrderedDict)
    assert hosts.lines == {"b": 1, "a": 3} and hosts.path == "hf" and hosts.warnings == ()
    clone = pickle.loads(pickle.dumps(hosts))
    assert clone == hosts and clone.lines == hosts.lines


def test_hostfile_warnings_for_odd_lines():
    hosts = parse_hostfile("\ufeffw0 slots=2 max_slots=4\nw1 slots=٣\nw2 slots=1 # fine\n")
    assert dict(hosts) == {"\ufeffw0": 2, "w1": 3, "w2": 1}
    text = " ".join(hosts.warnings)
    assert "'max_slots=4'" in text and "ignored" in text
    assert "non-ASCII digits" in text and "read as 3" in text
    assert "byte-order mark" in text
    assert len(hosts.warnings) == 3  # the trailing comment on w2 is not worth a warning


# --------------------------------------------------------------------------- filter errors

W1_W3 = "worker-1 slots=2\nworker-3 slots=4\n"


def test_slot_beyond_host_is_explained():
    hosts = parse_hostfile("worker-1 slots=2\n", path="hf/one")
    with pytest.raises(FilterError) as info:
        resolve_pool(hosts, include="worker-1:2,3")
    msg = str(info.value)
    one_sentence(msg)
    assert "'worker-1:2,3'" in msg and "2, 3" in msg and "worker-1" in msg
    assert "0..1" in msg and "slots=2" in msg and "hf/one" in msg and "(line 1)" in msg
    assert info.value.token == "worker-1:2,3"


def test_slot_beyond_host_names_only_the_missing_slots():
    hosts = parse_hostfile(W1_W3)
    with pytest.raises(FilterError, match=r"slot\(s\) 4 on worker-3") as info:
        resolve_pool(hosts, exclude="worker-1:0@worker-3:1,4")
    assert info.value.token == "worker-3:1,4"
    with pytest.raises(FilterError, match="no slots at all"):
        resolve_pool(parse_hostfile("z slots=0\nw slots=1"), include="z:0")
    with pytest.raises(FilterError, match="index 0"):
        resolve_pool(parse_hostfile("w slots=1"), include="w:-1")


def test_bare_host_selects_all_its_slots():
    pool = resolve_pool(parse_hostfile(W1_W3), include="worker-3")
    assert pool.as_dict() == {"worker-3": [0, 1, 2, 3]} and pool.world_size == 4
    assert pool.warnings == ()


@pytest.mark.parametrize("text,fragment", [
    ("localhost:0,1,", "ends with a comma"),
    ("localhost:", "no slots after it"),
    ("localhost:0,,1", "between two commas"),
    ("localhost:,1", "right after ':'"),
    ("localhost:x", "'x', which is not a whole number"),
    ("localhost:1:2", "more than one ':'"),
    ("localhost:" + "1" * 5000, "too long"),
])
def test_malformed_token_names_token_and_form(text, fragment):
    hosts = parse_hostfile("localhost slots=2\n")
    with pytest.raises(FilterError) as info:
        resolve_pool(hosts, include=text)
    msg = str(info.value)
    one_sentence(msg)
    assert fragment in msg and "NAME[:SLOT[,SLOT...]]" in msg
    assert info.value.token == text
    if len(text) < 100:
        assert repr(text) in msg
    with pytest.raises(FilterError, match=re.escape(fragment)):
        parse_filter(text, kind="exclude")


@pytest.mark.parametrize("text", ["a@@b", "@a", "a@", "", ":0"])
def test_empty_node_spec(text):
    with pytest.raises(FilterError, match="empty|no host name") as info:
        parse_filter(text)
    one_sentence(str(info.value))


def test_unknown_host_lists_hostfile_hosts():
    hosts = parse_hostfile(W1_W3, path="hf/w")
    with pytest.raises(FilterError) as info:
        resolve_pool(hosts, include="worker-1@worker-9:0")
    msg = str(info.value)
    one_sentence(msg)
    assert "'worker-9'" in msg and "hf/w" in msg and "worker-1, worker-3" in msg
    assert info.value.token == "worker-9:0"


def test_unknown_host_list_is_abbreviated():
    hosts = parse_hostfile("".join(f"n{i} slots=8\n" for i in range(500)))
    with pytest.raises(FilterError) as info:
        resolve_pool(hosts, exclude="n7@m3")
    msg = str(info.value)
    assert "n0, n1, n2" in msg and "and 494 more" in msg and len(msg) < 400


def test_unknown_host_with_whitespace_gets_a_hint():
    with pytest.raises(FilterError, match="contains whitespace"):
        resolve_pool(parse_hostfile(W1_W3), include="worker-1 @worker-3")


def test_include_and_exclude_together():
    with pytest.raises(FilterError) as info:
        resolve_pool(parse_hostfile(W1_W3), include="worker-1", exclude="worker-3")
    msg = str(info.value)
    one_sentence(msg)
    assert "include='worker-1'" in msg and "exclude='worker-3'" in msg
    assert "mutually exclusive" in msg


@pytest.mark.parametrize("kwargs,fields", [
    (dict(include="worker-1", num_nodes=1), ["num_nodes=1", "include='worker-1'"]),
    (dict(exclude="worker-1", num_gpus=2), ["num_gpus=2", "exclude='worker-1'"]),
    (dict(include="worker-1", num_nodes=0, num_gpus=0), ["num_nodes=0", "num_gpus=0"]),
])
def test_counts_with_filter(kwargs, fields):
    with pytest.raises(FilterError) as info:
        resolve_pool(parse_hostfile(W1_W3), **kwargs)
    msg = str(info.value)
    one_sentence(msg)
    assert all(f in msg for f in fields) and "-1" in msg


@pytest.mark.parametrize("kwargs", [dict(num_nodes="2"), dict(num_gpus=1.5), dict(num_nodes=True),
                                    dict(include=None)])
def test_bad_argument_types(kwargs):
    with pytest.raises(FilterError):
        resolve_pool(parse_hostfile(W1_W3), **kwargs)


@pytest.mark.parametrize("hosts", [{}, {"a": -1}, {"a": 1.0}, {"": 1}])
def test_bad_host_mappings(hosts):
    with pytest.raises(HostfileError):
        resolve_pool(hosts)


def test_all_errors_are_orch_errors():
    assert issubclass(HostfileError, OrchError) and issubclass(FilterError, OrchError)


# --------------------------------------------------------------------------- quirks -> warnings


def warned(pool: ResourcePool, *fragments: str) -> None:
    text = " | ".join(pool.warnings)
    for fragment in fragments:
        assert fragment in text, (fragment, pool.warnings)


def test_num_gpus_beyond_slots_is_kept_and_warned():
    pool = resolve_pool(parse_hostfile("w0 slots=2\nw1 slots=8\n"), num_gpus=4)
    assert pool.as_dict() == {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    warned(pool, "num_gpus=4", "w0", "slots=2")
    assert "w1" not in pool.warnings[0]


def test_zero_slot_host_stays_and_is_warned():
    hosts = parse_hostfile("z slots=0\nw slots=2\n")
    pool = resolve_pool(hosts)
    assert pool.nodes == (("z", ()), ("w", (0, 1))) and pool.world_size == 2
    warned(pool, "z", "slots=0", "no slots")
    pool = resolve_pool(hosts, num_nodes=1)
    assert pool.as_dict() == {"z": []}
    warned(pool, "count towards num_nodes")
    pool = resolve_pool(hosts, num_gpus=2)
    assert pool.as_dict() == {"z": [0, 1], "w": [0, 1]}
    warned(pool, "num_gpus=2", "z")
    pool = resolve_pool(hosts, exclude="w:0")
    assert pool.as_dict() == {"w": [1]}
    warned(pool, "does not name them")
    pool = resolve_pool(hosts, include="z")
    assert pool.as_dict() == {} and pool.world_size == 0
    warned(pool, "drops them", "the pool is empty")


def test_bare_and_slotted_host_merge_is_warned():
    hosts = parse_hostfile("w1 slots=4\nw2 slots=4\n")
    pool = resolve_pool(hosts, exclude="w1@w1:0")
    assert pool.as_dict() == {"w1": [1, 2, 3], "w2": [0, 1, 2, 3]}
    warned(pool, "removes only slot(s) 0", "not the whole host")
    pool = resolve_pool(hosts, include="w1@w1:0")
    assert pool.as_dict() == {"w1": [0]}
    warned(pool, "uses only slot(s) 0")


def test_order_and_odd_slot_text_are_warned():
    hosts = parse_hostfile("w1 slots=4\nw2 slots=4\n")
    pool = resolve_pool(hosts, include="w2:3,1@w1:+1")
    assert pool.nodes == (("w1", (1,)), ("w2", (1, 3)))
    warned(pool, "order w2, w1", "hostfile order: w1, w2", "sorted", "'+1'")


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(num_nodes=0), "num_nodes=0 does not limit"),
    (dict(num_gpus=0), "num_gpus=0 does not limit"),
    (dict(num_nodes=-3), "num_nodes=-3 is treated as not set"),
    (dict(num_nodes=7), "num_nodes=7 is more than the 2 host(s)"),
])
def test_count_quirks_are_warned(kwargs, fragment):
    pool = resolve_pool(parse_hostfile(W1_W3), **kwargs)
    assert pool.as_dict() == {"worker-1": [0, 1], "worker-3": [0, 1, 2, 3]}
    warned(pool, fragment)


def test_hostfile_warnings_carry_into_the_pool():
    hosts = parse_hostfile("w0 slots=2 max_slots=4\n", path="hf/x")
    pool = resolve_pool(hosts)
    assert pool.warnings == hosts.warnings and "hf/x" in pool.warnings[0]


def test_plain_cases_have_no_warnings():
    hosts = parse_hostfile(W1_W3)
    for kwargs in (dict(), dict(include="worker-1:1@worker-3"), dict(exclude="worker-3:0,2"),
                   dict(num_nodes=1, num_gpus=2)):
        assert resolve_pool(hosts, **kwargs).warnings == (), kwargs


# --------------------------------------------------------------------------- API and examples


def test_resource_pool_api():
    pool = resolve_pool(parse_hostfile(W1_W3), exclude="worker-3:0,2")
    assert pool.nodes == (("worker-1", (0, 1)), ("worker-3", (1, 3)))
    assert pool.hosts == ("worker-1", "worker-3") and pool.world_size == 4
    d = pool.as_dict()
    assert isinstance(d, collections.OrderedDict) and d == {"worker-1": [0, 1], "worker-3": [1, 3]}
    d["worker-1"].append(9)
    assert pool.as_dict()["worker-1"] == [0, 1]  # a copy
    with pytest.raises(AttributeError):
        pool.nodes = ()  # frozen
    assert resolve_pool({"a": 1, "b": 2}, source="inline").world_size == 3


def test_parse_filter_merges_sorts_and_dedups():
    assert parse_filter("w2:3,1,3@w1@w2:0") == {"w2": [0, 1, 3], "w1": []}
    assert list(parse_filter("b@a")) == ["b", "a"]
    assert parse_filter("w0: 1,+2,٣") == {"w0": [1, 2, 3]}


def test_example_hostfiles():
    expected = {"local-2x2": {"node-0": 2, "node-1": 2},
                "cluster-4x8": {f"worker-{i}": 8 for i in range(4)},
                "single-8": {"localhost": 8}}
    for name, hosts in expected.items():
        parsed = load_hostfile(HOSTFILES / name)
        assert list(parsed.items()) == list(hosts.items()) and parsed.warnings == ()
    readme = (HOSTFILES / "README.md").read_text(encoding="utf-8")
    for name in expected:
        assert f"`{name}`" in readme


def test_readme_filter_examples():
    hosts = load_hostfile(HOSTFILES / "cluster-4x8")
    all8 = list(range(8))
    assert resolve_pool(hosts, include="worker-1").as_dict() == {"worker-1": all8}
    assert resolve_pool(hosts, include="worker-2:0,1@worker-0:3").as_dict() == {
        "worker-0": [3], "worker-2": [0, 1]}
    assert resolve_pool(hosts, exclude="worker-3@worker-0:0").as_dict() == {
        "worker-0": all8[1:], "worker-1": all8, "worker-2": all8}
    assert resolve_pool(hosts, num_nodes=2, num_gpus=4).as_dict() == {
        "worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    local = load_hostfile(HOSTFILES / "local-2x2")
    assert resolve_pool(local, include="node-1:0").as_dict() == {"node-1": [0]}
    assert resolve_pool(local, exclude="node-0").as_dict() == {"node-1": [0, 1]}


def test_thousands_of_nodes_resolve_in_milliseconds():
    text = "".join(f"node-{i:05d} slots=8\n" for i in range(5000))
    include = "@".join(f"node-{i:05d}" + (":0,3,5" if i % 2 else "") for i in range(0, 5000, 2))
    exclude = "@".join(f"node-{i:05d}:{i % 8}" for i in range(5000))
    start = time.perf_counter()
    hosts = parse_hostfile(text)
    a = resolve_pool(hosts, include=include)
    b = resolve_pool(hosts, exclude=exclude)
    c = resolve_pool(hosts, num_nodes=4000, num_gpus=4)
    elapsed = time.perf_counter() - start
    assert a.world_size == 2500 * 8 and b.world_size == 5000 * 7 and c.world_size == 16000
    assert elapsed < 1.0, f"{elapsed:.3f}s"  # ~30 ms here; generous for a loaded CI box


@pytest.mark.parametrize("line", ["root:$y$j9T$Qm4yZfc0Uv7bJ8/2t$XyZ:19000:0:99999:7:::",
                                  "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAABlwAAAAdzc2gtcn",
                                  "export HF_TOKEN=hf_abc123 && python train.py"])
def test_a_line_of_another_file_is_named_never_quoted(tmp_path, line):
    path = write(tmp_path, line + "\nmore:secret$text\n")
    with pytest.raises(HostfileError) as info:
        load_hostfile(path)
    msg = str(info.value)
    one_sentence(msg)
    assert path in msg and "Line 1" in msg and "not shown" in msg and "right file" in msg
    assert not any(part in msg for part in line.split() if len(part) > 3) and info.value.line is None


def test_the_real_shadow_file_is_not_echoed():
    if not os.access("/etc/shadow", os.R_OK):
        pytest.fail("these tests run as root: /etc/shadow must be readable", pytrace=False)
    with open("/etc/shadow") as f:
        first = f.readline().strip()
    with pytest.raises(HostfileError) as info:
        load_hostfile("/etc/shadow")
    msg = str(info.value)
    assert first not in msg and (len(first.split(":")[1]) < 2 or first.split(":")[1] not in msg), msg
