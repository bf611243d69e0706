"""Every figure in the docs is measured by a named bench command or marked "not measured" (issue 21).

Scanned: README.md, docs/*.md and bench/README.md. Each file is split into paragraphs (runs of non-blank
lines); fenced code blocks (```` ``` ```` / ``~~~``) are skipped and end a paragraph. A markdown table (a
paragraph whose first line starts with ``|``) counts as one paragraph together with the paragraph right
before it, its caption.

A **figure** is a number, or a range of two (``4.3-5.9``), followed by one of the units ``s``, ``ms``,
``%``, ``x`` (``3 s``, ``0.69x``, ``12 %``, ``4,096 x``...), not followed by a letter or digit.

Not a claim (a setting, a formula or a shape, never a result), by these rules only:

* the figure is inside a code span (`` `timeout: 30 s` ``): a literal value the reader types or sees;
* ``N x M`` with a space on both sides of the ``x`` and a term after it (``4,096 x 8``, ``0.9 x hidden``):
  a product (nodes x slots, a formula), not a ratio; a ratio is written ``0.69x``, and "1.9 x the read"
  (an article after the ``x``) is one too;
* one of the words default, deadline, timeout, limit, interval, window, lease, target, goal, every comes
  right before the figure (at most 16 characters between them, with no digit and none of ``. ; ,``:
  ``default 30 s``, ``(goal: under 1 s)``, ``every 5 s``) or right after it (``the 3 s target``, ``a 60 s
  timeout``). Words like "after", "in", "up to" are not on the list: "FAILED after 0.03 s" is a measurement;
* the figure is the value of a knob named in a code span right beside it, the knob being an environment
  variable or constant (upper case with an underscore) or a command-line flag: ``ORCH_NODE_TIMEOUT_S``, 3 s /
  ``ORCH_AGENT_REATTACH_S`` (60 s) / for 60 s (``--stuck-after``). A command or a function in a code span
  is no knob: "``make_plan`` 140 ms" stays a claim.

A paragraph with at least one claim passes only if it names a bench command (``bench/<file>.py`` of a file
that exists, or ``python -m bench``), the suite's own timer (``tests/timing.py``, for docs/testing.md), or says
"not measured". The test lists every offender at once.

A **statement about another tool's behaviour** (issue 21, point 1) is, narrowly: one of DeepSpeed (or "the
runner", a `` `deepspeed ...` `` run, ``launch.py``), pdsh, torchrun, `` `accelerate launch` ``/Accelerate,
mpirun, mpiexec, srun/Slurm, Ray, gloo or NCCL, followed within three words (none of them "orch") by one of
never, hang(s), wait(s), leaves, notice(s), restart(s), ignore(s), drop(s), silently, quietly, keeps, ends,
exits, kill(s), refuses, warns, fail(s). Its paragraph passes only if it names its evidence: a bench
command or "not measured" (as above), an existing ``tests/<file>.py``, "not tested", or the tool's own code
in a code span (a ``.py`` file, a ``Class.method`` or a ``call()``: `` `runner.py main()` ``,
`` `DeepSpeedPlugin.fill_match` ``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.,\-–]){_NUM}(?:\s?[-–]\s?{_NUM})?\s?(?:ms|s|%|x)(?![\w])")
# "4,096 x 8", "0.9 x hidden": the x is spaced and a term (not an article) follows
PRODUCT_AFTER = re.compile(r"\s(?=x\s+(?!(?:the|a|an|its|that|what)\b)[\w(])")
SETTING_WORDS = r"(?:default|deadline|timeout|limit|interval|window|lease|target|goal|every)s?"
KNOB = r"`(?:[A-Z][A-Z0-9]*_[A-Z0-9_]+|--[a-z][\w-]*)`"  # an environment variable, a constant, a flag
KNOB_BEFORE = re.compile(rf"{KNOB}\s?[(,=:]?\s?$")
KNOB_AFTER = re.compile(rf"^\s{{0,3}}\(\s?{KNOB}")
SETTING_BEFORE = re.compile(rf"\b{SETTING_WORDS}\b[^\d.;,\n]{{0,16}}$", re.IGNORECASE)
SETTING_AFTER = re.compile(rf"^[\s)]{{0,3}}{SETTING_WORDS}\b", re.IGNORECASE)
BENCH_FILE = re.compile(r"\bbench/(\w+)\.py\b")
CODE_SPAN = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class Paragraph:
    """One paragraph of a markdown file: where it starts (1-based line) and its text (lines joined by \\n)."""

    path: Path
    line: int
    text: str


@dataclass(frozen=True)
class Offender:
    """A paragraph with claims and no bench command nor "not measured": its figures as written."""

    paragraph: Paragraph
    figures: tuple[str, ...]

    def describe(self) -> str:
        """``file:line: [figures] :: first words`` for the failure message."""
        path = self.paragraph.path
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        first = " ".join(self.paragraph.text.split()[:10])
        return f"{rel}:{self.paragraph.line}: {list(self.figures)} :: {first}"


def paragraphs(path: Path, text: str | None = None) -> list[Paragraph]:
    """The paragraphs of a markdown file, fenced code skipped, each table merged with the paragraph before it.

    ``text`` stands for the file's content when given (the file need not exist). A table right after a
    fence has no caption and stays alone.
    """
    lines = (path.read_text() if text is None else text).splitlines()
    out: list[Paragraph] = []
    cur: list[str] = []
    start, in_fence, fence_before = 0, False, False
    for no, line in enumerate([*lines, ""], 1):
        fence = bool(FENCE.match(line))
        if cur and (fence or not line.strip()):
            body = "\n".join(cur)
            if body.startswith("|") and out and not fence_before:
                prev = out.pop()
                out.append(Paragraph(path, prev.line, prev.text + "\n" + body))
            else:
                out.append(Paragraph(path, start, body))
            cur, fence_before = [], False
        if fence:
            in_fence, fence_before = not in_fence, True
        elif not in_fence and line.strip():
            start = start if cur else no
            cur.append(line)
    return out


def _is_setting(text: str, match: re.Match[str]) -> bool:
    """Whether the figure ``match`` in ``text`` is a setting, product or literal by the module's rules."""
    a, b = match.span()
    if any(s.start() < a and b <= s.end() for s in CODE_SPAN.finditer(text)):
        return True
    figure = match.group()
    if figure.endswith("x") and PRODUCT_AFTER.match(text, b - 2 if figure[-2:-1].isspace() else b - 1):
        return True
    before, after = text[max(0, a - 60):a], text[b:b + 60]
    return bool(SETTING_BEFORE.search(before) or SETTING_AFTER.match(after)
                or KNOB_BEFORE.search(before) or KNOB_AFTER.match(after))


def claims(text: str) -> list[str]:
    """The figures of ``text`` that are claims (measured results), in order, as written."""
    return [m.group().replace("\n", " ") for m in FIGURE.finditer(text) if not _is_setting(text, m)]


def cites_source(text: str, bench_dir: Path = ROOT / "bench") -> bool:
    """Whether ``text`` names an existing bench script, ``python -m bench``, tests/timing.py (the suite's own
    seconds: docs/testing.md), or says "not measured"."""
    flat = " ".join(text.split())
    if "python -m bench" in flat or "tests/timing.py" in flat or "not measured" in flat.lower():
        return True
    return any((bench_dir / f"{m.group(1)}.py").exists() for m in BENCH_FILE.finditer(flat))


def _offending(files: list[Path], said: Callable[[str], list[str]], backed: Callable[[str], bool]) -> list[Offender]:
    """Every paragraph of ``files`` in which ``said`` finds something and ``backed`` finds no evidence."""
    found = []
    for path in files:
        for para in paragraphs(path):
            what = said(para.text)
            if what and not backed(para.text):
                found.append(Offender(para, tuple(what)))
    return found


def offenders(files: list[Path], bench_dir: Path = ROOT / "bench") -> list[Offender]:
    """Every paragraph of ``files`` with a claim and no source (bench scripts looked up in ``bench_dir``)."""
    return _offending(files, claims, lambda text: cites_source(text, bench_dir))


TOOL = (r"(?:DeepSpeed(?:'s)?(?: \w+)?|the runner|`deepspeed[^`\n]*`(?: run)?|`?launch\.py`?|pdsh|`?torchrun`?"
        r"|`accelerate launch`|Accelerate(?:'s \w+)?|`?mpirun`?|`?mpiexec`?|`?srun`?(?: step)?|Slurm|Ray(?: actor)?"
        r"|gloo|NCCL)")
BEHAVIOUR = (r"(?:never|hangs?|waits?|leaves|notices?|restarts?|ignores?|drops?|silently|quietly|keeps|ends|exits"
             r"|kills?|refuses|warns|fails?)")
TOOL_CLAIM = re.compile(rf"(?<!\w){TOOL}\s+(?:(?!orch\b)[\w'`,]+\s+){{0,3}}?{BEHAVIOUR}\b")
TOOL_CODE = re.compile(r"`[^`\n]*(?:\.py\b|\b[A-Z]\w*\.\w+|\w\(\))[^`\n]*`")
TEST_FILE = re.compile(r"\btests/(\w+)\.py\b")
OWN_FILE = re.compile(r"\b(?:tests|bench|examples|orchestrator|agents)/[\w/]*\.py\b")  # this project's, not the tool's


def tool_claims(text: str) -> list[str]:
    """The statements about another tool's behaviour in ``text`` (its words from the tool to the verb)."""
    return [m.group() for m in TOOL_CLAIM.finditer(" ".join(text.split()))]


def cites_evidence(text: str, root: Path = ROOT) -> bool:
    """Whether ``text`` names evidence for a tool's behaviour: what ``cites_source`` accepts, an existing
    ``tests/<file>.py`` under ``root``, "not tested", or the tool's code in a code span."""
    flat = " ".join(text.split())
    if cites_source(flat, root / "bench") or "not tested" in flat.lower() or TOOL_CODE.search(OWN_FILE.sub("", flat)):
        return True
    return any((root / "tests" / f"{m.group(1)}.py").exists() for m in TEST_FILE.finditer(flat))


def tool_offenders(files: list[Path], root: Path = ROOT) -> list[Offender]:
    """Every paragraph of ``files`` with a statement about another tool's behaviour and no evidence."""
    return _offending(files, tool_claims, lambda text: cites_evidence(text, root))


def doc_files() -> list[Path]:
    """README.md, docs/*.md and bench/README.md of this checkout."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def test_every_figure_in_the_docs_names_its_bench_command_or_says_not_measured() -> None:
    files = doc_files()
    assert all(f.exists() for f in files)
    bad = offenders(files)
    if bad:
        pytest.fail(f"{len(bad)} paragraphs state figures with no bench command and no 'not measured':\n"
                    + "\n".join(o.describe() for o in bad), pytrace=False)


def test_every_statement_about_another_tools_behaviour_names_its_evidence() -> None:
    bad = tool_offenders(doc_files())
    if bad:
        pytest.fail(f"{len(bad)} paragraphs say what another tool does with no bench command, test, code of the "
                    "tool, 'not measured' or 'not tested':\n" + "\n".join(o.describe() for o in bad), pytrace=False)


# The scanner's own rules, on small texts.

def test_a_table_is_one_paragraph_with_its_caption_and_fences_are_skipped(tmp_path: Path) -> None:
    text = ("Intro 3 s.\n\nCaption, from `bench/x.py`:\n\n| a | b |\n|---|---|\n| 1 | 2.5 s |\n\n"
            "```sh\nsleep 9 s\n\nmore 4 s\n```\n\n| after | a fence |\n|---|---|\n| 7 % | |\n")
    paras = paragraphs(tmp_path / "d.md", text)
    assert [p.line for p in paras] == [1, 3, 15]
    assert paras[1].text.endswith("| 1 | 2.5 s |")
    assert "sleep" not in " ".join(p.text for p in paras)


def test_figures_units_and_ranges() -> None:
    assert claims("exits in 4.3-5.9 s, 0.69x, 12 %, 10.57s, 7 ms, 0.4–1.6 s and 4,096 nodes") == \
        ["4.3-5.9 s", "0.69x", "12 %", "10.57s", "7 ms", "0.4–1.6 s"]
    assert claims("3 steps, 5 slots, 0x1f, v1.5 s, step=0") == []
    assert claims("ready in 0.10\ns") == ["0.10 s"]


def test_settings_products_and_literals_are_not_claims_but_measurements_are() -> None:
    assert claims("the deadline `--timeout` (120 s) and `hang: 30 s`, sampled every 5 s, default 60 s") == []
    assert claims("4,096 x 8 slots, int(0.9 x hidden^2), 2 x 1 GPUs") == []
    assert claims("a full hash is 1.9 x the read") == ["1.9 x"]
    assert claims("under the 3 s target; a 60 s timeout") == []
    assert claims("`ORCH_NODE_TIMEOUT_S`, 3 s, `ORCH_AGENT_REATTACH_S` (60 s), for 60 s (`--stuck-after`)") == []
    assert claims("has run for 120 s\n  (`ORCH_SLURM_IDLE_S`)") == []
    assert claims("`make_plan` 140 ms, `orch plan --offline` 1.9 s, `hash_file` (0.42 s)") == \
        ["140 ms", "1.9 s", "0.42 s"]
    assert claims("detected in 0.08 s (goal: under 1 s)") == ["0.08 s"]
    assert claims("FAILED after 0.028s, up to 10 %, 1.9x, the run took 5 s") == ["0.028s", "10 %", "1.9x", "5 s"]


def test_a_paragraph_passes_with_an_existing_bench_script_python_m_bench_or_not_measured(tmp_path: Path) -> None:
    (tmp_path / "real.py").write_text("")
    assert cites_source("from `bench/real.py --rounds 5`", tmp_path)
    assert not cites_source("from `bench/invented.py`", tmp_path)
    assert not cites_source("see [bench/README.md](bench/README.md)", tmp_path)
    assert cites_source("written by `python -m bench`", tmp_path)
    assert cites_source("Not measured by a bench command: from a test run", tmp_path)
    assert cites_source("the suite's seconds (`python tests/timing.py run`)", tmp_path)
    doc = tmp_path / "d.md"
    doc.write_text("Took 3 s.\n\nTook 4 s (`bench/real.py`).\n\nNot a figure: 3 steps.\n")
    assert [o.paragraph.line for o in offenders([doc], tmp_path)] == [1]


def test_the_page_python_m_bench_writes_names_the_command_in_every_paragraph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_main", ROOT / "bench" / "__main__.py")
    bench_main = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_main", bench_main)  # its dataclasses look their module up
    spec.loader.exec_module(bench_main)
    printed = "round 1: orch 10.57s  bare 4.67s\n| system | median |\n|---|---|\n| orch | 10.27 s |\n\n\nratio 0.41x\n"
    page = bench_main.label_output(printed, "python bench/launch_ssh.py --rounds 5")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("## A section\n\n" + page + "\n\n(`python bench/launch_ssh.py --rounds 5` took 344 s)\n")
    paras = paragraphs(doc)
    assert [claims(p.text) for p in paras] == [[], ["10.57s", "4.67s", "10.27 s"], ["0.41x"], ["344 s"]]
    assert offenders([doc]) == []


def test_statements_about_other_tools_and_the_evidence_that_passes_them(tmp_path: Path) -> None:
    assert tool_claims("DeepSpeed's runner never notices a cut link; torchrun restarts every node") == \
        ["DeepSpeed's runner never", "torchrun restarts"]
    assert tool_claims("a bare `deepspeed --hostfile` run\nhangs; pdsh leaves processes; Accelerate silently keeps") \
        == ["`deepspeed --hostfile` run hangs", "pdsh leaves", "Accelerate silently"]
    assert tool_claims("DeepSpeed's semantics; orch refuses; the runner's exports; NCCL_DEBUG") == []
    assert tool_claims("DeepSpeed's launchers orch never changes") == []  # orch is the subject
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_real.py").write_text("")
    for evidence in ["`tests/test_real.py`", "not tested here", "Not measured", "`runner.py` `main()`",
                     "(`DeepSpeedPlugin.fill_match`)", "`fetch_hostfile()`"]:
        assert cites_evidence(f"pdsh leaves processes ({evidence}).", tmp_path), evidence
    for none in ["`tests/test_invented.py`", "`examples/train.py`", "a test", "`deepspeed`", "`--launcher`"]:
        assert not cites_evidence(f"pdsh leaves processes ({none}).", tmp_path), none
    doc = tmp_path / "d.md"
    doc.write_text("pdsh leaves processes.\n\npdsh leaves processes (`tests/test_real.py`).\n\norch never hangs.\n")
    assert [o.paragraph.line for o in tool_offenders([doc], tmp_path)] == [1]
