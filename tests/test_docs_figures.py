"""The docs describe the present, and their figures come from result files.

docs/performance.md (CPU) and docs/tpu.md (accelerators) each have one section "## Figures". Its
tables are the only place where the project's measured figures live. The checks:

- Each figures table has the columns "measured", "figure", "machine", "command" and "result file",
  and every row fills them. The result file cell links one or more files under bench/results/
  (`[name.json](../bench/results/name.json)`), and each of those files exists.
- Every number in a row's "figure" cell occurs in one of its result files. The rule for what is
  checked is the column: only the "figure" cell holds measurements. Row counts, context lengths,
  prompt sizes and other settings belong in the "measured" cell, which is not checked. A figure
  matches a number anywhere in the JSON (any depth) that rounds to it at the figure's own
  precision: 150.7 matches 150.72, 2,805 matches 2805.4, and a percent (84.1%) also matches a
  fraction (0.841).
- Each doc has at least MIN_ROWS rows, so the check cannot pass on an empty table.
- No doc under docs/ carries history: no date except in a result file's name or a figures table
  row, and none of the diary phrases in HISTORY_PHRASES. History goes to CHANGELOG.md.
- Relative links between the docs, README.md and CHANGELOG.md point at files and headings that
  exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MIN_ROWS = {"performance.md": 30, "tpu.md": 30}
COLUMNS = ("measured", "figure", "machine", "command", "result file")
HISTORY_PHRASES = (
    "What was changed, and why",
    "before this session",
    "this session",
    "were not recorded",
    "not re-measured",
    "formerly",
)

# A number as the docs write it: 150.7, 2,805, 1e-4, 84.1%, 1.27x (not the 8 of "int8" or the 2 of "E2B").
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:e(-?\d+))?(%?)(?!\d)")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
RESULT_NAME = re.compile(r"[\w.*-]*20\d\d-[01]\d-[0-3]\d[\w.*-]*\.json")
RESULT_LINK = re.compile(r"\]\((\.\./bench/results/[^)\s]+\.json)\)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def figures_section(name: str) -> list[str]:
    """The lines of a doc's "## Figures" section (up to the next "## " heading)."""
    lines = (DOCS / name).read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "## Figures"]
    assert len(starts) == 1, f"docs/{name} must have exactly one '## Figures' section"
    end = next((i for i in range(starts[0] + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[starts[0] + 1:end]


def figure_rows(name: str) -> list[dict[str, str]]:
    """Every row of every table in the Figures section, as {column: cell}."""
    rows, header = [], None
    for line in figures_section(name) + [""]:
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            assert all(c in header for c in COLUMNS), f"docs/{name}: a figures table has columns {header}"
        elif not all(set(c) <= set("-: ") for c in cells):
            assert len(cells) == len(header), f"docs/{name}: row has {len(cells)} cells: {line}"
            rows.append(dict(zip(header, cells)))
    return rows


def json_numbers(path: Path) -> list[float]:
    """Every number in a JSON file, at any depth."""
    out: list[float] = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(float(x))

    walk(json.loads(path.read_text(encoding="utf-8")))
    return out


def occurs(figure: tuple[str, str, str, str], numbers: list[float]) -> bool:
    """Whether a number as written in a doc is one of `numbers` at the doc's rounding."""
    whole, frac, exp, percent = figure
    scale = 10.0 ** int(exp) if exp else 1.0
    value = float(whole.replace(",", "") + frac) * scale
    tolerance = 0.5 * 10.0 ** -(len(frac) - 1 if frac else 0) * scale + 1e-9
    factors = (1.0, 100.0) if percent else (1.0,)
    return any(abs(n * f - value) <= tolerance for n in numbers for f in factors)


@pytest.mark.parametrize("name", sorted(MIN_ROWS))
def test_every_figure_is_in_its_result_file(name):
    rows = figure_rows(name)
    assert len(rows) >= MIN_ROWS[name], f"docs/{name}: {len(rows)} figure rows, expected at least {MIN_ROWS[name]}"
    problems = []
    for row in rows:
        for column in COLUMNS:
            if not row[column]:
                problems.append(f"empty '{column}': {row['measured']}")
        links = RESULT_LINK.findall(row["result file"])
        if not links:
            problems.append(f"no result file linked: {row['measured']}")
        paths = [(DOCS / link).resolve() for link in links]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            problems.append(f"result file missing {missing}: {row['measured']}")
            continue
        numbers = [n for p in paths for n in json_numbers(p)]
        for figure in NUMBER.findall(row["figure"]):
            if not occurs(figure, numbers):
                written = figure[0] + figure[1] + (f"e{figure[2]}" if figure[2] else "") + figure[3]
                problems.append(f"{written} is not in {[p.name for p in paths]}: {row['measured']}")
    assert not problems, f"docs/{name}:\n" + "\n".join(problems)


def test_figures_live_in_one_section():
    for name in MIN_ROWS:
        lines = (DOCS / name).read_text(encoding="utf-8").splitlines()
        inside = set(figures_section(name))
        headers = [line for i, line in enumerate(lines) if line.startswith("|") and line not in inside
                   and (i == 0 or not lines[i - 1].startswith("|"))]
        assert not [h for h in headers if "figure" in _cells(h)], f"docs/{name}: a figures table outside '## Figures'"


def test_a_stale_figure_is_caught():
    numbers = [150.72, 2805.4, 0.841, 1e-4]
    assert all(occurs(f, numbers) for f in NUMBER.findall("150.7 tok/s, 2,805 tok/s, 84.1%, 1e-4"))
    assert not any(occurs(f, numbers) for f in NUMBER.findall("150.8 tok/s, 2,806 tok/s, 84.2%"))
    assert NUMBER.findall("int8 E2B bf16") == []
    assert [f[0] + f[1] for f in NUMBER.findall("1.27x, 12.3 s.")] == ["1.27", "12.3"]


def test_no_doc_carries_history():
    problems = []
    for path in sorted(DOCS.glob("*.md")):
        figure_lines = set(figures_section(path.name)) if path.name in MIN_ROWS else set()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"docs/{path.name}:{number}"
            if line in figure_lines and line.startswith("|"):
                continue
            if DATE.search(RESULT_NAME.sub("", line)):
                problems.append(f"{where}: a date outside a result file's name: {line.strip()[:100]}")
            problems += [f"{where}: '{p}'" for p in HISTORY_PHRASES if p.lower() in line.lower()]
    assert not problems, "history belongs in CHANGELOG.md:\n" + "\n".join(problems)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_links_between_docs_resolve():
    problems = []
    for path in sorted(DOCS.glob("*.md")) + [ROOT / "README.md", ROOT / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not problems, "\n".join(problems)
