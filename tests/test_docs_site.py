"""The documentation: README.md is the front door (short, the two quick-start commands, the
dependency table), docs/ is a site that mkdocs builds strictly (a broken link or anchor, or a
page left out of the nav, fails), and what the pages name in the tree exists. A few seconds."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
pytestmark = pytest.mark.timeout(60)

QUICK_START = [
    "bash scripts/quickstart.sh demo",
    "bash scripts/quickstart.sh test",
]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # mkdocs comes with the `test` extra: a missing one is a broken environment, not a skip.
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=50)


def _section(text: str, heading: str) -> str:
    """The body of the markdown section ``heading`` (a whole line), up to the next heading."""
    start = text.index(heading + "\n") + len(heading) + 1
    following = re.compile(r"^#{1,6} ", re.M).search(text, start)
    return text[start:following.start() if following else len(text)]


def _fences(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_the_site_builds_strictly(tmp_path):
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    for page in DOCS.glob("*.md"):
        built = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (tmp_path / "site" / built).is_file(), f"{page.name} was not built"


def test_the_strict_build_fails_on_a_broken_link_a_broken_anchor_and_a_page_not_in_the_nav(tmp_path):
    # The strictness is in mkdocs.yml's `validation:` (mkdocs' defaults only log these): prove it.
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a") as index:
        index.write("\n[gone](no-such-page.md) and [no anchor](cli.md#no-such-anchor)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    out = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0
    for what in ("no-such-page.md", "no-such-anchor", "orphan.md"):
        assert what in out.stderr, (what, out.stderr)


def test_the_readme_reads_in_five_minutes_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    quick = _section(text, "## Quick start")
    commands = [line.split("#")[0].strip() for block in _fences(quick, "bash") for line in block.splitlines()]
    # The first bash block of the quick start is the two commands, exactly.
    assert _fences(quick, "bash")[0].count("\n") == 2
    assert [c for c in commands if c.startswith("bash scripts/")] == QUICK_START
    # CI runs the second one.
    assert re.search(r"^exec bash scripts/quickstart\.sh test$", (ROOT / ".ci" / "run").read_text(), re.M)
    # The sections a newcomer needs.
    for heading in ("## Quick start", "### Installing torch", "### Dependencies, and why",
                    "## The training-loop API", "## What happens on each fault", "## Documentation"):
        assert heading + "\n" in text, heading
    api = _fences(_section(text, "## The training-loop API"), "python")
    assert api and len(api[0].splitlines()) <= 25
    assert "--index-url" in _section(text, "### Installing torch")  # how GPU users bring their own torch


def _dependency_rows(text: str) -> dict[str, str]:
    rows = {}
    for line in _section(text, "### Dependencies, and why").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] not in ("package", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_dependency_table_justifies_every_dependency():
    rows = _dependency_rows(README.read_text())
    named = {name.strip() for key in rows for name in re.sub(r"\(.*?\)", "", key).split(",")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + [d for extra in project["optional-dependencies"].values() for d in extra]
    for requirement in wanted:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        assert name in named, f"{name} (pyproject.toml) has no row in README's dependency table"
    assert "torch" in named
    assert all(why for why in rows.values())
    # The site carries the same table (docs/user-guide.md), word for word.
    guide = (DOCS / "user-guide.md").read_text().replace("## Dependencies, and why", "### Dependencies, and why")
    assert _dependency_rows(guide) == rows


def test_links_and_paths_in_the_readme_and_the_docs_exist():
    # mkdocs checks links between pages; the README is not a page, and the pages name files of
    # the tree as code (`unbroken/recovery/ladder.py`, `controller/machine.py`): check those here.
    packages = sorted(p.name for p in (ROOT / "unbroken").iterdir() if (p / "__init__.py").is_file())
    tree = re.compile(r"`((?:unbroken|examples|deploy|benchmarks|scripts|tests|docs|%s)/[\w./-]*)`" % "|".join(packages))
    missing = []
    for page in _pages():
        text = page.read_text()
        if page == README:
            for target in re.findall(r"\]\(([^)\s]+)\)", text):
                if not re.match(r"[a-z]+:", target) and not (ROOT / target.split("#")[0]).exists():
                    missing.append(f"README.md links {target}")
        for path in tree.findall(text):
            if not (ROOT / path).exists() and not (ROOT / "unbroken" / path).exists():
                missing.append(f"{page.name} names {path}")
    assert missing == []


def test_the_architecture_page_maps_every_package():
    text = (DOCS / "architecture.md").read_text()
    layers, layout = _fences(_section(text, "## The layers"), ""), _fences(_section(text, "## Layout"), "")
    assert layers and layout
    for entry in sorted((ROOT / "unbroken").iterdir()):
        if entry.name.startswith("__"):
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            assert re.search(rf"^  {entry.name}/ ", layout[0], re.M), f"Layout lacks {entry.name}/"
            assert re.search(rf"\b{entry.name}\b", layers[0]), f"the layers drawing lacks {entry.name}"
        elif entry.suffix == ".py":
            assert re.search(rf"^  {entry.name} ", layout[0], re.M), f"Layout lacks {entry.name}"
            assert re.search(rf"\b{entry.stem}\b", layers[0]), f"the layers drawing lacks {entry.stem}"
