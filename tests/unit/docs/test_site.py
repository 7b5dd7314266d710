"""The README and the documentation site's shape: what a newcomer is promised is there."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[3]
DOCS = ROOT / "docs"
SETUP_AND_RUN = (
    "./scripts/setup.sh && .venv/bin/omnirail run examples/quickstart/pipeline.yaml "
    "--input-file examples/quickstart/input.json"
)


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_the_readme_is_short_and_holds_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert f"\n{SETUP_AND_RUN}\n" in text
    assert "\n./scripts/test.sh\n" in text


def test_every_link_of_the_readme_reaches_a_file() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local
    for link in local:
        assert (ROOT / link).is_file(), link


def test_the_site_has_every_page_the_nav_names_and_the_pages_we_promise() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = _nav_pages(config["nav"])
    for page in pages:
        assert (DOCS / page).is_file(), page
    promised = [
        "getting-started.md", "concepts.md", "guides/pipelines.md", "guides/testing.md",
        "guides/streaming.md", "guides/placement.md", "guides/relays.md", "guides/security.md",
        "guides/front-doors.md", "guides/observability.md", "guides/compose.md",
        "guides/kubernetes.md", "guides/supervision.md", "guides/benchmarks.md",
        "models/qwen3-omni.md", "models/omni-demo.md", "reference/configuration.md",
        "reference/cli.md", "reference/sdk.md", "reference/stage.md",
    ]  # fmt: skip
    assert set(promised) <= set(pages)
    assert "docs/hooks/reference.py" in config["hooks"]


def test_measurements_are_dated_pages_that_say_host_and_command() -> None:
    pages = sorted((DOCS / "measurements").glob("*.md"))
    dated = [p for p in pages if p.name != "index.md"]
    assert dated
    index = (DOCS / "measurements/index.md").read_text(encoding="utf-8")
    for page in dated:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", page.name), page.name
        text = page.read_text(encoding="utf-8")
        assert text.startswith(f"# {page.name[:10]}: "), page.name
        assert "**Host:**" in text and "**Command" in text and "```sh" in text, page.name
        assert f"({page.name})" in index, page.name
