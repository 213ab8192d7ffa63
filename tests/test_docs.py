"""The docs site builds with `mkdocs build --strict`, every page is in its navigation, and the README stays short.

`mkdocs.yml` turns every link, anchor and navigation check into a warning and `strict` makes a warning an
error, so this build fails on a link to a missing page or heading, an image that is not under docs/, or
a page left out of `nav`. The README is the five-minute page: at most 250 lines, and every figure it
quotes is also in the docs, where it is explained (docs/contributing.md says where things go).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.test_readme import FENCE_RE, REPO, make_environment, venv_python

README_MAX_LINES = 250
DOCS = REPO / "docs"
# A figure: a number standing alone (not part of a name such as Qwen3, v12, bf16 or qwen3_14b).
FIGURE_RE = re.compile(r"(?<![\w.,+-])[+-]?\d+(?:[.,]\d+)*%?(?![\w]|[.,]\d)")
LINK_TARGET_RE = re.compile(r"\]\([^)]*\)")


def _mkdocs_config() -> dict:
    return yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            if isinstance(value, list):
                pages += _nav_pages(value)
            else:
                pages.append(value)
    return pages


def test_the_site_builds_strict_with_no_warning(tmp_path: Path) -> None:
    env = make_environment()
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's notice about MkDocs 2.0, printed on every build
    proc = subprocess.run(
        [venv_python(), "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    if "No module named mkdocs" in proc.stdout:
        pytest.fail("mkdocs is not installed: it is a dev requirement (requirements/dev.txt), run `make install`")
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-6000:]}"
    warnings = [line for line in proc.stdout.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_navigation_once_and_the_checks_stay_on() -> None:
    config = _mkdocs_config()
    assert config["docs_dir"] == "docs" and config["strict"] is True and config["theme"]["name"] == "material"
    validation = config["validation"]
    for key in ("not_found", "anchors", "absolute_links", "unrecognized_links"):
        assert validation["links"][key] == "warn", f"validation.links.{key} must stay 'warn' (strict fails on it)"
    assert validation["nav"]["omitted_files"] == "warn"
    pages = _nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md")), "nav and docs/*.md differ"
    assert len(pages) == len(set(pages)), "a page is in nav twice"
    assert pages[0] == "index.md"


def test_the_makefile_serves_the_docs_on_loopback_only() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    serve = [line for line in makefile.splitlines() if "mkdocs serve" in line]
    assert serve and all("-a 127.0.0.1:" in line for line in serve), serve


def test_the_readme_is_at_most_250_lines() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


def _prose(text: str) -> str:
    """`text` without fenced blocks, HTML comments and link targets: what a reader reads as figures."""
    kept, fence = [], None
    for line in text.splitlines():
        opening = FENCE_RE.match(line)
        if opening:
            if fence is None:
                fence = opening.group("fence")[0]
                continue
            if opening.group("fence")[0] == fence and not opening.group("info"):
                fence = None
                continue
        if fence is None:
            kept.append(line)
    prose = re.sub(r"<!--.*?-->", "", "\n".join(kept), flags=re.DOTALL)
    return LINK_TARGET_RE.sub("]", prose)


def figures(text: str) -> set[str]:
    """The numbers of `text`'s prose, signs and percent kept: `+3.46`, `0.52`, `4,904`, `10%`."""
    return {m.group(0).lstrip("+-").rstrip("%") for m in FIGURE_RE.finditer(_prose(text))}


def test_figures_ignore_names_code_and_link_targets() -> None:
    text = (
        "Qwen3 at v12 gained **+3.46 [+3.00, +3.95]** on 56 games, 10% of 4,904 groups ([x](docs/a.md#v-1-2)).\n"
        '```bash\nmake run   # 999\n```\n<!-- readme-test: skip reason="777" -->\n'
    )
    assert figures(text) == {"3.46", "3.00", "3.95", "56", "10", "4,904"}


def test_every_figure_in_the_readme_is_also_in_the_docs() -> None:
    docs = "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    missing = sorted(
        figure
        for figure in figures((REPO / "README.md").read_text(encoding="utf-8"))
        if not re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d]|[.,]\d)", docs)
    )
    assert not missing, f"figures in README.md that no page of docs/ holds (add them to docs/results.md): {missing}"
