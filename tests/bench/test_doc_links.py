"""Every figure the README and docs/ cite comes from a result file that exists: each ``benchmarks/results/...`` path
they name is in the repository (or is what a named command writes), and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"benchmarks/results/[\w./\-]+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# paths a command writes rather than a figure's source: each must be named by the command that writes it
WRITTEN_BY = {"benchmarks/results/gpu_suite/latest.json": "benchmarks/run.sh"}


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def missing_results(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in RESULT.finditer(line):
                path = m.group(0).rstrip(".,:;")
                if path in WRITTEN_BY:
                    assert path.removeprefix("benchmarks/results/") in (ROOT / WRITTEN_BY[path]).read_text()
                elif not (ROOT / path).exists():
                    out.append(f"{f.name}:{i}: {path}")
    return out


def broken_links(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1).split("#")[0]
                if target and not target.startswith(("http://", "https://", "mailto:")) and not (
                        f.parent / target).exists():
                    out.append(f"{f.name}:{i}: {target}")
    return out


def test_every_cited_result_file_exists():
    files = _docs()
    assert len(files) > 10 and sum(len(RESULT.findall(f.read_text())) for f in files) > 20
    assert missing_results(files) == []


def test_every_relative_link_resolves():
    assert broken_links(_docs()) == []


def test_a_dangling_result_or_link_fails_the_check(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("42 tokens/s ([md](results/speed/none.md)), see benchmarks/results/nowhere.json and "
                   "benchmarks/results/README.md\n")
    assert missing_results([doc]) == ["page.md:1: benchmarks/results/nowhere.json"]
    assert broken_links([doc]) == ["page.md:1: results/speed/none.md"]
