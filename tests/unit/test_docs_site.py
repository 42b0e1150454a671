"""The README is the front door and the docs site holds the rest: the README stays short, its
links resolve, its settings table matches the config models, the docs carry no diary (commit
hashes), and `mkdocs build --strict` (broken links, missing pages) passes where mkdocs is
installed (the `docs` extra)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollart.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _prose(text: str) -> str:
    """Markdown without fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_readme_is_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "make train" in text and "make test" in text


def test_every_relative_link_in_the_readme_exists():
    links = LINK.findall(README.read_text())
    relative = [u for u in links if not re.match(r"[a-z]+:", u) and not u.startswith("#")]
    assert len(relative) >= 10
    missing = [u for u in relative if not (ROOT / u.split("#")[0]).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert "guides/multi-turn-env.md" in pages
    missing = [p for p in pages if p not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"


def _get(obj, path: str):
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else (
            obj[part] if isinstance(obj, dict) else getattr(obj, part))
    return obj


def test_the_readme_settings_table_matches_the_config():
    """Each row: key | model default | configs/default.yaml | what it does."""
    text = README.read_text()
    section = text[text.index("## The ten settings that matter"):]
    rows = re.findall(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \| `([^`]*)` \|", section, re.M)
    assert len(rows) == 10, rows
    model = RunConfig()
    default_yaml = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    for key, model_default, yaml_value in rows:
        assert str(_get(model, key)) == model_default, key
        try:
            in_yaml = _get(default_yaml, key)
        except (KeyError, IndexError):
            in_yaml = _get(model, key)  # not set in the file: the model's default applies
        assert str(in_yaml) == yaml_value, key


def test_no_commit_hashes_in_the_readme_or_the_docs():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    found = {p.relative_to(ROOT).as_posix(): HASH.findall(_prose(p.read_text())) for p in pages}
    assert not {p: h for p, h in found.items() if h}


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("material") is None,
                    reason="mkdocs is not installed (the `docs` extra)")
def test_mkdocs_build_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"NO_MKDOCS_2_WARNING": "1", **_env()})
    assert out.returncode == 0, out.stdout + out.stderr
    config = (tmp_path / "site/reference/configuration/index.html").read_text()
    assert "rollout.max_staleness" in config and "model.tiny.num_layers" in config
    cli = (tmp_path / "site/reference/cli/index.html").read_text()
    assert "rollart train" in cli and "check-config" in cli
    bench = (tmp_path / "site/benchmarks/index.html").read_text()
    assert "results/quickstart.json" in bench and "unreadable" not in bench
    assert "fonts.googleapis" not in (tmp_path / "site/index.html").read_text()


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
