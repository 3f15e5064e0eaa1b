"""The README and docs/ stay what a user reads: short, current, and true to the repository. Each test reads files only
(no engine): sizes, no wording from the story of how the project was built, links that resolve, commands that exist,
and a benchmarks page that is exactly what `python benchmarks/report.py` renders from the committed results."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

# Work-session wording: which session of the project's builders measured or changed something. A Lab session (one
# harness run) is the other "session" and stays: "this session's key" in a docstring is about that one.
STORY_IN_DOCS = re.compile(r"\b(this|last|previous|next|earlier|later|[a-z]+(teenth|tieth|ieth)|first|second|"
                           r"third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(st|nd|rd|th)) "
                           r"sessions?\b", re.IGNORECASE)
STORY_IN_CODE = re.compile(r"\b(last|previous|earlier|later|[a-z]+(teenth|tieth|ieth)|fourth|fifth|sixth|seventh|"
                           r"eighth|ninth|tenth|eleventh|twelfth|\d+(st|nd|rd|th)) session\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_readme_and_the_docs_stay_short():
    assert lines(README) <= 150, f"README.md has {lines(README)} lines; the bar is 150 (the rest goes to docs/)"
    total = sum(lines(p) for p in DOCS)
    assert total <= 2500, f"docs/ has {total} lines: {', '.join(f'{p.name} {lines(p)}' for p in DOCS)}"


def _tracked_python() -> list[Path]:
    """The repository's Python files and notebooks (git's list; a copy without .git: the project's own folders)."""
    out = subprocess.run(["git", "ls-files", "*.py", "*.ipynb"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout:
        return [ROOT / name for name in out.stdout.split()]
    folders = ("polar_lab", "tests", "benchmarks", "scripts", "notebooks")
    return [p for folder in folders for pattern in ("*.py", "*.ipynb") for p in (ROOT / folder).rglob(pattern)]


def test_no_page_docstring_or_comment_tells_which_work_session_did_what():
    found = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in PAGES
             for n, line in enumerate(p.read_text().splitlines(), 1) for m in STORY_IN_DOCS.finditer(line)]
    found += [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in _tracked_python() if p != Path(__file__)
              for n, line in enumerate(p.read_text().splitlines(), 1) for m in STORY_IN_CODE.finditer(line)]
    assert not found, "the history belongs in git, not in the text:\n" + "\n".join(found)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens and underscores, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def test_every_link_in_the_readme_and_the_docs_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, re.MULTILINE))


def _commands(page: Path) -> list[str]:
    """Every command line the page shows: the lines of its code blocks and its inline code spans."""
    text = page.read_text()
    shown = [line for block in FENCE.finditer(text) for line in block.group(0).splitlines()[1:-1]]
    shown += CODE_SPAN.findall(FENCE.sub("", text))
    return [line.strip() for line in shown]


COMMAND = re.compile(r"(?:^|\s|`)(?:\S*/)?(make|polar-lab|python)\s+(.*)$")


def problems_of(command: str, targets: set[str]) -> list[str]:
    """What in `command` the repository does not have: a make target, a polar-lab subcommand or flag, a script or
    module, a flag of that script, a config file."""
    m = COMMAND.search(command)
    if not m:
        return []
    tool, rest = m.group(1), m.group(2).split("#")[0]
    words = rest.split()
    if not words:
        return []
    if tool == "make":
        return [f"no make target {w!r}" for w in words if not w.startswith("-") and "=" not in w
                and re.fullmatch(r"[a-z][\w-]*", w) and w not in targets][:1]
    if tool == "polar-lab":
        source, head = ROOT / "polar_lab" / "cli.py", words[0]
        if not re.fullmatch(r"[a-z][\w-]*", head):
            return []
        if f'add_parser("{head}"' not in source.read_text():
            return [f"no polar-lab subcommand {head!r}"]
    elif words[0] == "-m":
        if len(words) < 2 or not words[1].startswith("polar_lab"):
            return []
        module = words[1]
        if find_spec(module) is None:
            return [f"no module {module!r}"]
        source = Path(find_spec(module).origin)
    else:
        if not re.fullmatch(r"(benchmarks|scripts)/[\w.-]+\.py", words[0]):
            return []
        source = ROOT / words[0]
        if not source.exists():
            return [f"no script {words[0]!r}"]
    text = source.read_text()
    missing = [f"{source.relative_to(ROOT)} has no flag {flag!r}" for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", rest)
               if f'"{flag}"' not in text]
    missing += [f"no file {path!r}" for path in re.findall(r"(?<!\S)(configs/[\w./-]+\.yaml)", rest)
                if not (ROOT / path).exists()]
    return missing


def test_every_command_the_readme_and_the_guides_show_exists():
    targets = _makefile_targets()
    missing = [f"{page.relative_to(ROOT)}: `{command}`: {problem}" for page in PAGES for command in _commands(page)
               for problem in problems_of(command, targets)]
    assert not missing, "\n".join(missing)


def test_the_command_check_tells_real_commands_from_missing_ones():
    targets = _makefile_targets()
    assert problems_of("make test", targets) == [] and problems_of("make tests", targets)
    assert problems_of(".venv/bin/polar-lab train configs/tiny_calc_grpo.yaml --max-steps 2", targets) == []
    assert problems_of("polar-lab train configs/nope.yaml", targets) == ["no file 'configs/nope.yaml'"]
    assert problems_of("polar-lab serve", targets) == ["no polar-lab subcommand 'serve'"]
    assert problems_of("python benchmarks/report.py --check", targets) == []
    assert problems_of("python benchmarks/report.py --fast", targets) == [
        "benchmarks/report.py has no flag '--fast'"]
    assert problems_of("python -m polar_lab.envs.swe ROWS --repos DIR --out FILE", targets) == []
    assert problems_of("python -m polar_lab.nothing", targets) == ["no module 'polar_lab.nothing'"]


def test_the_benchmarks_page_is_what_the_committed_results_render():
    out = subprocess.run([sys.executable, "benchmarks/report.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + "run `python benchmarks/report.py` and commit docs/benchmarks.md"


@pytest.mark.parametrize("text, story", [("measured in the sixteenth session", True), ("an earlier session tried", True),
                                         ("this session's make test runs", True), ("each session's key", False)])
def test_the_story_check_reads_work_sessions_not_lab_sessions(text, story):
    assert bool(STORY_IN_DOCS.search(text)) is story


def test_a_benchmarks_result_file_holds_machine_date_command_and_renders_as_a_section(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
        import result
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "storage.py"), "--turns", "3"])
    monkeypatch.chdir(ROOT)
    path = result.save("storage", {"calls.jsonl (MB)": 0.8, "rows": 1234}, title="Storage",
                       tables=[{"title": "t", "columns": ["a", "b"], "rows": [[1, 2.5]]}], notes=["a note"],
                       out=tmp_path / "storage.json")
    saved = json.loads(path.read_text())
    assert saved["command"] == "python benchmarks/storage.py --turns 3" and saved["machine"]["cores"] >= 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", saved["date"])
    text = "\n".join(report.section(path))
    assert text.startswith("## Storage — `benchmarks/storage.py`") and "`python benchmarks/storage.py --turns 3`" in text
    assert "| 0.8 | 1,234 |" in text and "| 1 | 2.5 |" in text and "- a note" in text
    with pytest.raises(AssertionError, match="ragged"):
        result.save("x", {}, tables=[{"title": "t", "columns": ["a"], "rows": [[1, 2]]}], out=tmp_path / "x.json")


def test_the_benchmarks_page_describes_a_script_once_however_many_result_files_it_wrote(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for name, command in [("storage", "python benchmarks/storage.py"), ("storage_b", "python benchmarks/storage.py -b"),
                          ("trajectory_cost", "python benchmarks/trajectory_cost.py")]:
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "benchmark": name.removesuffix("_b"), "command": command, "date": "2026-12-07", "machine": "m",
            "figures": {"x": 1}}))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    page = report.render()
    storage, cost = report.description("storage"), report.description("trajectory_cost")
    assert storage and cost and page.count(storage) == 1 and page.count(cost) == 1
    assert page.count("`benchmarks/storage.py`") == 2 and "`python benchmarks/storage.py -b`" in page
