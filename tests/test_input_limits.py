"""No input makes orch misbehave: specs, hostfiles, filters, Accelerate YAML and DeepSpeed JSON that are
alias bombs, 1,000 levels deep, full of NUL bytes, 50 MB, binary junk or a pipe are each one clear error
naming the file and the limit (docs/security.md). In process (``load_spec``, Hypothesis for the random
ones), then through ``orch plan`` in a subprocess: exit 2, no traceback, its peak RSS measured."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from orchestrator.errors import OrchError
from orchestrator.planning import load_hostfile, resolve_pool
from orchestrator.spec import load_spec
from orchestrator.spec.files import MAX_DEPTH, MAX_INPUT_BYTES

BOMB = """name: bomb
entrypoint: train.py
deepspeed_config:
  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
  b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
  c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
  d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
  e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
  f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
  g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
  h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
  i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""
MEASURE = """import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
sys.stderr.write(f"\\nmaxrss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n")
sys.exit(code)
"""
ACCELERATE_BOMB = BOMB.split("deepspeed_config:\n", 1)[1].replace("\n  ", "\n").lstrip()


def _dir(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def _spec(tmp_path: Path, text: str) -> Path:
    path = _dir(tmp_path) / "job.yaml"
    path.write_text(text)
    return path


def _deep_yaml(levels: int) -> str:
    return "name: deep\nentrypoint: train.py\ndeepspeed_config: " + "[" * levels + "]" * levels + "\n"


def _inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Each hostile input as a spec file, with a phrase its error must contain."""
    d = _dir(tmp_path)
    big = d / "big.bin"
    with open(big, "wb") as f:
        f.truncate(50 << 20)  # 50 MB (sparse)
    (d / "deep.json").write_text("[" * 1000 + "]" * 1000)
    (d / "accel-bomb.yaml").write_text(ACCELERATE_BOMB)
    (d / "junk.bin").write_bytes(bytes(range(256)) * 64)
    (d / "bignum.json").write_text('{"train_batch_size": ' + "9" * 100_000 + "}")
    (d / "shadow-like").write_text("root:$y$j9T$Qm4yZfc0Uv7bJ8/2t$XyZ:19000:0:99999:7:::\n")
    base = "name: x\nentrypoint: train.py\n"
    cases = {
        "alias bomb in the spec": (BOMB, "alias bomb"),
        "self-referencing alias": (base + "deepspeed_config: &a {x: *a}\n", "refers to the value it is in"),
        "1000-deep YAML": (_deep_yaml(1000), f"more than {MAX_DEPTH} levels deep"),
        "NUL bytes": (base + "args: ['a\x00b']\n\x00\x00\n", "not valid YAML"),
        "50 MB spec": (None, f"at most {MAX_INPUT_BYTES >> 20} MiB"),
        "binary spec": (None, "not UTF-8"),
        "1000-deep DeepSpeed JSON": (base + f"deepspeed_config: {d / 'deep.json'}\n", f"more than {MAX_DEPTH} levels"),
        "50 MB DeepSpeed JSON": (base + f"deepspeed_config: {big}\n", f"at most {MAX_INPUT_BYTES >> 20} MiB"),
        "alias bomb in an Accelerate config": (base + f"accelerate_config: {d / 'accel-bomb.yaml'}\n", "alias bomb"),
        "50 MB hostfile": (base + f"hostfile: {big}\n", f"larger than {MAX_INPUT_BYTES >> 20} MiB"),
        "binary hostfile": (base + f"hostfile: {d / 'junk.bin'}\n", "not UTF-8"),
        "another file as the hostfile": (base + f"hostfile: {d / 'shadow-like'}\n", "not shown"),
        "a filter of 100,000 hosts": (base + "include: " + "@".join(f"h{i}" for i in range(100_000)) + "\n", ""),
        "a 100,000-digit number in the spec": (base + "num_nodes: " + "9" * 100_000 + "\n", "number too long"),
        "a 100,000-digit number in DeepSpeed JSON": (base + f"deepspeed_config: {d / 'bignum.json'}\n",
                                                     "number too long"),
    }
    out = {}
    for name, (text, phrase) in cases.items():
        path = d / f"{name.replace(' ', '-').replace(',', '')}.yaml"
        if name == "50 MB spec":
            path = big
        elif name == "binary spec":
            path = d / "junk.bin"
        else:
            path.write_text(text)
        out[name] = (path, phrase)
    return out


def test_each_hostile_input_is_one_clear_error(tmp_path) -> None:
    for name, (path, phrase) in _inputs(tmp_path).items():
        t0 = time.monotonic()
        try:
            spec = load_spec(path)
            if spec.hostfile:
                resolve_pool(load_hostfile(spec.hostfile), spec.include, spec.exclude)
        except OrchError as err:
            assert phrase in str(err), (name, str(err))
            assert "Traceback" not in str(err) and "$y$" not in str(err)
        else:
            assert name == "a filter of 100,000 hosts", f"{name}: no error"
        assert time.monotonic() - t0 < 30, name


def test_a_pipe_as_hostfile_or_config_is_refused_not_waited_on(tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()
    errors = []

    def read() -> None:
        for spec in (f"name: x\nentrypoint: train.py\nhostfile: {fifo}\n",
                     f"name: x\nentrypoint: train.py\ndeepspeed_config: {fifo}\n"):
            try:
                s = load_spec(_spec(tmp_path, spec))
                load_hostfile(s.hostfile) if s.hostfile else None
            except OrchError as err:
                errors.append(str(err))
        done.set()
    threading.Thread(target=read, daemon=True).start()
    if not done.wait(20):
        with open(fifo, "w"):  # let the stuck reader go, then fail
            pass
        pytest.fail("a FIFO was waited on")
    assert len(errors) == 2 and all("not a regular file" in e for e in errors), errors


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=2000), st.text(max_size=2000),
                 st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20)),
                              lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                     st.dictionaries(st.text(max_size=10), kids, max_size=5)),
                              max_leaves=40).map(lambda v: yaml.safe_dump({"name": "h", "entrypoint": "train.py",
                                                                           "deepspeed_config": v, "env": v}))))
def test_random_spec_files_give_errors_not_tracebacks(tmp_path, content) -> None:
    path = _dir(tmp_path) / "random.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    try:
        load_spec(path)
    except OrchError as err:
        assert str(err)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=3000))
def test_random_hostfiles_and_filters_give_errors_not_tracebacks(text) -> None:
    from orchestrator.planning.hostfile import parse_hostfile
    try:
        hosts = parse_hostfile(text)
        resolve_pool(hosts, text[:200] or None, None)
    except OrchError as err:
        assert str(err)


@pytest.mark.integration
def test_orch_plan_refuses_each_with_exit_2_in_bounded_memory(tmp_path) -> None:
    worst = (0, "")
    for name, (path, phrase) in _inputs(tmp_path).items():
        t0 = time.monotonic()
        # measured by a small parent: a child forked from this (large) pytest process would count pytest's
        # memory at the fork as its own peak (Linux keeps the old mm's high-water mark across exec)
        r = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "orchestrator", "plan", str(path)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "ORCH_STATE_DIR": str(tmp_path / "s")})
        err, _, last = r.stderr.rstrip("\n").rpartition("\n")
        code, seconds, rss_mib = r.returncode, time.monotonic() - t0, int(last.split()[1]) / 1024
        if name == "a filter of 100,000 hosts":
            assert code == 2 and "Traceback" not in err, (name, err[-2000:])
        else:
            assert code == 2 and phrase in " ".join(err.split()) and "Traceback" not in err, (name, err[-2000:])
        assert seconds < 60, (name, seconds)
        worst = max(worst, (rss_mib, name))
        print(f"\n[input limits] {name}: exit {code} in {seconds:.2f} s, peak RSS {rss_mib:.0f} MiB")
    print(f"[input limits] largest peak RSS of any orch plan: {worst[0]:.0f} MiB ({worst[1]})")
    assert worst[0] < 400, worst
