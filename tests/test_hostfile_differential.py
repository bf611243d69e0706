"""orchestrator.planning.hostfile against DeepSpeed's own runner functions, on generated inputs.

The oracle is the installed ``deepspeed.launcher.runner``: ``_parse_hostfile`` (fed the
lines a text-mode ``readlines()`` gives, as ``fetch_hostfile`` does), ``fetch_hostfile``,
``parse_node_config_list``, ``parse_inclusion_exclusion``, ``apply_num_nodes_and_gpus``
and ``main()``'s num_nodes/num_gpus-versus-include/exclude check. For every input either
both give the same OrderedDict (same hosts, same order, same slots), or DeepSpeed raises
(any exception) and orch raises a HostfileError/FilterError.

Examples run: 1200 hostfile texts + 1600 pool resolutions + 600 filters + 200 files =
3600, derandomized so CI sees the same ones every run.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import tempfile
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.launcher import runner as ds  # noqa: E402

from orchestrator.errors import FilterError, HostfileError  # noqa: E402
from orchestrator.planning import (  # noqa: E402
    load_hostfile,
    parse_filter,
    parse_hostfile,
    resolve_pool,
)

ORCH_ERRORS = (HostfileError, FilterError)


def _settings(n: int) -> settings:
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def _quiet_deepspeed():
    """DeepSpeed logs every bad hostfile and every excluded slot; keep the run quiet."""
    ds_logger = logging.getLogger("DeepSpeed")
    saved = ds_logger.disabled, ds.logger.disabled
    ds_logger.disabled = ds.logger.disabled = True
    yield
    ds_logger.disabled, ds.logger.disabled = saved


# --------------------------------------------------------------------------- oracle


def ds_parse_text(text: str):
    """What fetch_hostfile would return for a file with this text (universal newlines)."""
    return ds._parse_hostfile(io.StringIO(text, newline=None).readlines())


def ds_resolve(hosts, include, exclude, num_nodes, num_gpus):
    """DeepSpeed main()'s path from resource_pool to active_resources (hostfile given)."""
    if num_nodes >= 0 or num_gpus >= 0:
        if include != "" or exclude != "":
            raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
    active = ds.parse_inclusion_exclusion(hosts, include, exclude)
    return ds.apply_num_nodes_and_gpus(active, num_nodes, num_gpus)


def _outcome(fn):
    try:
        return True, fn()
    except Exception as err:  # the oracle may raise anything
        return False, err


def _raises(errors, fn) -> None:
    """``fn`` raises one of orch's ``errors`` with a one-line, one-sentence message."""
    with pytest.raises(errors) as info:
        fn()
    message = str(info.value)
    assert message[:1].isupper() and message.endswith(".") and "\n" not in message, message


def _same_ordered(ours, theirs) -> None:
    assert list(ours.items()) == list(theirs.items())
    assert ours == theirs


def check_hostfile_text(text: str) -> None:
    ok, theirs = _outcome(lambda: ds_parse_text(text))
    if not ok:
        _raises(HostfileError, lambda: parse_hostfile(text))
        return
    ours = parse_hostfile(text)
    _same_ordered(ours, theirs)
    assert all(isinstance(w, str) and w for w in ours.warnings)


def check_pool(text: str, include: str, exclude: str, num_nodes: int, num_gpus: int) -> None:
    ok, theirs_hosts = _outcome(lambda: ds_parse_text(text))
    if not ok:
        _raises(HostfileError, lambda: parse_hostfile(text))
        return
    hosts = parse_hostfile(text)
    _same_ordered(hosts, theirs_hosts)
    ok, theirs = _outcome(lambda: ds_resolve(theirs_hosts, include, exclude, num_nodes, num_gpus))
    if not ok:
        _raises(ORCH_ERRORS, lambda: resolve_pool(hosts, include, exclude, num_nodes, num_gpus))
        return
    pool = resolve_pool(hosts, include, exclude, num_nodes, num_gpus)
    _same_ordered(pool.as_dict(), theirs)
    assert pool.world_size == sum(len(v) for v in theirs.values())
    assert pool.hosts == tuple(theirs)
    assert all(isinstance(w, str) and w for w in pool.warnings)


# --------------------------------------------------------------------------- strategies

HOSTS = ["w0", "w1", "w2", "worker-10", "localhost", "10.0.0.2", "n#1", "é", "fe80::1", "a@b",
         "W0"]
WS = [" ", " ", " ", "\t", "  ", "\x0b", "\x0c", "\xa0", "\u2003", "\x85", "\u3000", "\x1c"]
NEWLINES = ["\n", "\n", "\n", "\n", "\r\n", "\r", "\u2028"]
GOOD_COUNTS = ["0", "1", "2", "3", "4", "8", "16", "08", "007", "٣", "３", "१२"]
BAD_COUNTS = ["", "-1", "+2", "x", "2.5", "1_0", " 2", "1" * 5000]
TRAILERS = ["", "", "", " # rack 3", "#c", "abc", " max_slots=9", "\t", " slots=4", "\u2003x"]
BROKEN_LINES = ["{h}", "{h} 8", "slots=3", "{h} slots = 3", "{h} lots=8", "{h}:slots=2",
                "{h}slots=2", "{h} slots=", "{h} slots=-1", "{h} max_slots=2 slots=2",
                "{h} SLOTS=2", " ; {h} slots=2", "\ufeff{h} slots=2", "\ufeff# comment"]

ws = st.sampled_from(WS)
opt_ws = st.one_of(st.just(""), ws)
any_host = st.one_of(st.sampled_from(HOSTS),
                     st.text(st.characters(codec="utf-8"), min_size=1, max_size=6))
# Host-like names: no whitespace, not starting with '#', but any other character.
odd_host = st.one_of(st.sampled_from(HOSTS), st.sampled_from(HOSTS), st.text(
    st.characters(codec="utf-8", exclude_categories=["Zs", "Zl", "Zp", "Cc"]),
    min_size=1, max_size=6).filter(lambda h: not h.startswith("#") and len(h.split()) == 1))


def chance(draw, percent: int) -> bool:
    return draw(st.integers(0, 99)) < percent


@st.composite
def entry_line(draw, host: str, good: bool = True) -> str:
    """``host slots=<n>`` with odd whitespace, digits and trailers (valid if ``good``)."""
    keyword, count = "slots=", draw(st.sampled_from(GOOD_COUNTS))
    if not good:
        if chance(draw, 50):
            count = draw(st.sampled_from(BAD_COUNTS))
        else:
            keyword = draw(st.sampled_from(["slots =", "SLOTS=", "lots=", "slots"]))
    return (draw(opt_ws) + host + draw(ws) + keyword + count + draw(st.sampled_from(TRAILERS))
            + draw(opt_ws))


comment_line = st.builds(lambda a, b: a + "#" + b, opt_ws, st.text(max_size=8))
blank_line = st.lists(ws, max_size=3).map("".join)


@st.composite
def hostfile_text(draw) -> str:
    """Mostly well-formed hostfiles (with odd spacing), sometimes anything at all."""
    if chance(draw, 60):
        hosts = draw(st.lists(odd_host, min_size=0 if chance(draw, 5) else 1, max_size=6,
                              unique=True))
        if hosts and chance(draw, 10):
            hosts.insert(draw(st.integers(0, len(hosts))), draw(st.sampled_from(hosts)))
        lines = [draw(entry_line(h, good=not chance(draw, 5))) for h in hosts]
        for _ in range(draw(st.integers(0, 3))):
            lines.insert(draw(st.integers(0, len(lines))),
                         draw(st.one_of(comment_line, blank_line)))
    else:
        lines = draw(st.lists(st.one_of(
            any_host.flatmap(lambda h: entry_line(h, good=True)),
            any_host.flatmap(lambda h: entry_line(h, good=False)),
            comment_line, blank_line,
            st.builds(lambda t, h: t.format(h=h), st.sampled_from(BROKEN_LINES),
                      st.sampled_from(HOSTS)),
            st.text(max_size=12)), max_size=8))
    out = ""
    for text in lines:
        out += text + draw(st.sampled_from(NEWLINES))
    if out and chance(draw, 30):
        out = out[:-1]  # no final newline (may split a \r\n, which is fine)
    return out


ODD_SLOTS = ["-1", "99", "", " 1", "1 ", "+1", "1_0", "٣", "x", "0x1", "1" * 5000, "00"]
ODD_NAMES = ["zz", "", " w0", "w0 ", "W1", "w", "a@b", "fe80::1"]
ODD_SPECS = ["{n}:1:2", ":0", "{n}:", "{n}:0,", "{n}:,0", "{n}::0", "{n}:0,,1"]


@st.composite
def node_spec(draw, hosts: dict[str, int]) -> str:
    """A NODE_SPEC, usually naming an existing host and slot, sometimes anything."""
    name = (draw(st.sampled_from(sorted(hosts))) if hosts and chance(draw, 90)
            else draw(st.sampled_from(ODD_NAMES + HOSTS)))
    roll = draw(st.integers(0, 99))
    if roll < 40:
        return name
    if roll < 45:
        return draw(st.sampled_from(ODD_SPECS)).format(n=name)
    count = hosts.get(name, 0)
    items = []
    for _ in range(draw(st.integers(1, 4))):
        if count and chance(draw, 90):
            items.append(str(draw(st.integers(0, count - 1))))
        else:
            items.append(draw(st.sampled_from(ODD_SLOTS + ["0", "1", "2", "3"])))
    return name + ":" + ",".join(items)


@st.composite
def filter_text(draw, hosts: dict[str, int]) -> str:
    specs = draw(st.lists(node_spec(hosts), min_size=1, max_size=4))
    sep = "@" if chance(draw, 90) else draw(st.sampled_from(["@@", " @", "@ "]))
    text = sep.join(specs)
    if chance(draw, 5):
        text = draw(st.sampled_from(["@", " "])) + text
    if chance(draw, 5):
        text += draw(st.sampled_from(["@", " "]))
    return text


valid_hosts = st.lists(st.tuples(st.sampled_from(HOSTS[:8]), st.integers(0, 6)),
                       min_size=1, max_size=6, unique_by=lambda t: t[0]).map(dict)


@st.composite
def pool_case(draw):
    """A hostfile (usually valid) plus include/exclude/num_nodes/num_gpus."""
    if chance(draw, 10):
        text, hosts = draw(hostfile_text()), {h: 2 for h in HOSTS}
    else:
        hosts = draw(valid_hosts)
        text = "".join(f"{h}{draw(ws)}slots={n}{draw(st.sampled_from(TRAILERS))}\n"
                       for h, n in hosts.items())
    nums = st.sampled_from([-1, -1, -1, -1, 0, 0, -2, 1, 2, 3, 5, 9])
    mode = draw(st.sampled_from(["none", "include", "include", "include", "exclude", "exclude",
                                 "exclude", "both", "nums", "nums", "nums", "nums+filter",
                                 "nums+filter"]))
    include = exclude = ""
    num_nodes = num_gpus = -1
    if mode in ("include", "both"):
        include = draw(filter_text(hosts))
    if mode in ("exclude", "both"):
        exclude = draw(filter_text(hosts))
    if mode in ("nums", "nums+filter"):
        num_nodes, num_gpus = draw(nums), draw(nums)
    if mode == "nums+filter":
        if chance(draw, 50):
            include = draw(filter_text(hosts))
        else:
            exclude = draw(filter_text(hosts))
    return text, include, exclude, num_nodes, num_gpus


# --------------------------------------------------------------------------- properties


@_settings(1200)
@given(hostfile_text())
def test_parse_hostfile_matches_deepspeed(text: str) -> None:
    check_hostfile_text(text)


@_settings(800)
@given(pool_case())
def test_resolve_pool_matches_deepspeed(case) -> None:
    check_pool(*case)


@_settings(800)
@given(st.data())
def test_resolve_pool_filters_match_deepspeed(data) -> None:
    """Only include/exclude on valid hostfiles: where most of DeepSpeed's logic lives."""
    hosts = data.draw(valid_hosts)
    text = "".join(f"{h} slots={n}\n" for h, n in hosts.items())
    flt = data.draw(filter_text(hosts))
    if data.draw(st.booleans()):
        check_pool(text, flt, "", -1, -1)
    else:
        check_pool(text, "", flt, -1, -1)


@_settings(600)
@given(st.one_of(filter_text({h: 4 for h in HOSTS}), st.text(max_size=12),
                 st.text(st.sampled_from("w01:,@ -+٣"), max_size=12)))
def test_parse_filter_matches_deepspeed(text: str) -> None:
    ok, theirs = _outcome(lambda: ds.parse_node_config_list(text))
    if not ok:
        _raises(FilterError, lambda: parse_filter(text))
        return
    if "" in theirs:
        # The one documented difference: DeepSpeed returns host '' for an empty NODE_SPEC
        # (e.g. 'a@@b'), which its filter then always rejects; orch rejects it here.
        _raises(FilterError, lambda: parse_filter(text))
        return
    ours = parse_filter(text)
    assert list(ours.items()) == list(theirs.items())


@pytest.fixture(scope="module")
def scratch_dir():
    with tempfile.TemporaryDirectory(prefix="orch-hostfile-") as d:
        yield d


@_settings(200)
@given(hostfile_text())
def test_load_hostfile_matches_fetch_hostfile(scratch_dir, text: str) -> None:
    """fetch_hostfile reads with the locale's encoding, orch always with UTF-8 (a deliberate
    difference): the oracle is made to read UTF-8 too, whatever this machine's locale."""
    path = os.path.join(scratch_dir, "hostfile")
    with open(path, "wb") as fh:  # bytes as generated: \r\n and \r stay in the file
        fh.write(text.encode("utf-8", "surrogatepass"))
    utf8_open = functools.partial(open, encoding="utf-8")
    with mock.patch.object(ds, "open", utf8_open, create=True):
        ok, theirs = _outcome(lambda: ds.fetch_hostfile(path))
    if not ok:
        _raises(HostfileError, lambda: load_hostfile(path))
        return
    _same_ordered(load_hostfile(path), theirs)


def test_missing_hostfile_is_the_one_divergence(scratch_dir) -> None:
    """DeepSpeed falls back to local GPUs (None); orch refuses, naming the path."""
    missing = os.path.join(scratch_dir, "no-such-hostfile")
    assert ds.fetch_hostfile(missing) is None
    assert ds.fetch_hostfile(scratch_dir) is None
    for path in (missing, scratch_dir):
        with pytest.raises(HostfileError, match=path):
            load_hostfile(path)


# --------------------------------------------------------------------------- table

H22 = "w0 slots=2\nw1 slots=2\n"
H_ZERO = "z slots=0\nw0 slots=2\nw1 slots=3\n"
ERR = "error"

# (hostfile, include, exclude, num_nodes, num_gpus, DeepSpeed's pool or ERR)
TRICKY = [
    (H22, "", "", -1, -1, {"w0": [0, 1], "w1": [0, 1]}),
    (H22, "w1", "", -1, -1, {"w1": [0, 1]}),
    (H22, "w1@w0:1", "", -1, -1, {"w0": [1], "w1": [0, 1]}),  # hostfile order, not filter's
    (H22, "w0:1,0,1", "", -1, -1, {"w0": [0, 1]}),  # sorted, de-duplicated
    (H22, "w0@w0:1", "", -1, -1, {"w0": [1]}),  # bare + slots = slots only
    (H22, "", "w0@w0:1", -1, -1, {"w0": [0], "w1": [0, 1]}),  # exclude removes only slot 1
    (H22, "w0:0@w0:1", "", -1, -1, {"w0": [0, 1]}),  # repeated host merges
    (H22, "w0: 1", "", -1, -1, {"w0": [1]}),  # int() strips whitespace
    (H22, "w0:+1", "", -1, -1, {"w0": [1]}),
    (H22, "w0:0_1", "", -1, -1, {"w0": [1]}),  # int('0_1') == 1
    (H22, "w0:١", "", -1, -1, {"w0": [1]}),  # Arabic-Indic digit one
    (H22, "", "w0:0,1", -1, -1, {"w1": [0, 1]}),  # all slots removed: host dropped
    (H22, "", "w0@w1", -1, -1, {}),  # empty pool, no error
    (H22, "w0:2", "", -1, -1, ERR),  # slot out of range
    (H22, "w0:-1", "", -1, -1, ERR),
    (H22, "w0:0,", "", -1, -1, ERR),  # int('')
    (H22, "w0:", "", -1, -1, ERR),
    (H22, "w0:1:2", "", -1, -1, ERR),  # too many values to unpack
    (H22, "w0@@w1", "", -1, -1, ERR),  # host ''
    (H22, "@w0", "", -1, -1, ERR),
    (H22, " w0", "", -1, -1, ERR),  # names are not stripped
    (H22, " ", "", -1, -1, ERR),  # non-empty include
    (H22, "W0", "", -1, -1, ERR),  # case-sensitive
    (H22, "w0", "w1", -1, -1, ERR),  # mutually exclusive
    (H22, "w0", "", 0, -1, ERR),  # 0 counts as set
    (H22, "", "w0", -1, 0, ERR),
    (H22, "w0", "", -2, -1, {"w0": [0, 1]}),  # -2 is not set
    (H22, "", "", 0, 0, {"w0": [0, 1], "w1": [0, 1]}),  # 0 limits nothing
    (H22, "", "", 1, -1, {"w0": [0, 1]}),
    (H22, "", "", 5, -1, {"w0": [0, 1], "w1": [0, 1]}),  # more nodes than exist
    (H22, "", "", -1, 4, {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}),  # more gpus than slots
    (H22, "", "", 1, 1, {"w0": [0]}),
    (H_ZERO, "", "", -1, -1, {"z": [], "w0": [0, 1], "w1": [0, 1, 2]}),  # kept, empty
    (H_ZERO, "", "", 1, -1, {"z": []}),  # num_nodes counts the empty host
    (H_ZERO, "", "", 1, 2, {"z": [0, 1]}),  # num_gpus gives it slots
    (H_ZERO, "z", "", -1, -1, {}),  # included, then dropped as empty
    (H_ZERO, "z:0", "", -1, -1, ERR),
    (H_ZERO, "", "w1:2", -1, -1, {"w0": [0, 1], "w1": [0, 1]}),  # z dropped though not named
    ("w0 slots=2 max_slots=4\n", "", "", -1, -1, {"w0": [0, 1]}),  # trailing text ignored
    ("w0 slots=2#x\r\nw1\tslots=٣\r", "", "", -1, -1, {"w0": [0, 1], "w1": [0, 1, 2]}),
    ("w0\u2028slots=1\n", "", "", -1, -1, {"w0": [0]}),  # U+2028 is whitespace, not a newline
    ("w0 slots=1\rw1 slots=1", "", "", -1, -1, {"w0": [0], "w1": [0]}),  # lone \r ends a line
    ("w0 slots=08\n", "", "", -1, -1, {"w0": list(range(8))}),
    ("  # c\n\n\tw0 slots=1  \n", "", "", -1, -1, {"w0": [0]}),
    ("fe80::1 slots=2\n", "", "", -1, -1, {"fe80::1": [0, 1]}),
    ("fe80::1 slots=2\n", "fe80::1", "", -1, -1, ERR),  # ':' cannot be named in a filter
    ("w0 slots=1\nw0 slots=1\n", "", "", -1, -1, ERR),  # duplicate
    ("w0 lots=1\n", "", "", -1, -1, ERR),
    ("w0 slots = 1\n", "", "", -1, -1, ERR),
    ("w0 SLOTS=1\n", "", "", -1, -1, ERR),
    ("w0 slots=-1\n", "", "", -1, -1, ERR),
    ("slots=1\n", "", "", -1, -1, ERR),
    ("# nothing\n\n", "", "", -1, -1, ERR),  # empty
    ("", "", "", -1, -1, ERR),
    ("\ufeff# BOM then comment\nw0 slots=1\n", "", "", -1, -1, ERR),  # BOM hides the '#'
    ("\ufeffw0 slots=1\n", "", "", -1, -1, {"\ufeffw0": [0]}),
    ("w0 slots=" + "9" * 5000 + "\n", "", "", -1, -1, ERR),  # int() digit limit
]


@pytest.mark.parametrize("text,include,exclude,num_nodes,num_gpus,expected", TRICKY)
def test_tricky_cases(text, include, exclude, num_nodes, num_gpus, expected) -> None:
    ok, theirs = _outcome(lambda: ds_resolve(ds_parse_text(text), include, exclude,
                                             num_nodes, num_gpus))
    if expected == ERR:
        assert not ok, f"DeepSpeed accepted it: {theirs!r}"
    else:
        assert ok, f"DeepSpeed raised {theirs!r}"
        assert list(theirs.items()) == list(expected.items())
    check_pool(text, include, exclude, num_nodes, num_gpus)
