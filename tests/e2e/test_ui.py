"""Browser test: headless Debian Chromium opens the Prefect UI of the stack, finds the `train`
deployment, starts a run with the UI's own "Run > Quick run", follows it to Completed and looks
at its artifacts (the reward/success chart must render as an image). Screenshots go to
results/ (ui_quick_run.png, ui_artifacts.png)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("ROLLART_CHROMIUM", "/usr/bin/chromium")
RESULTS = Path(__file__).resolve().parents[2] / "results"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser_or_skip() -> None:
    """Locally a missing browser skips; in CI (CI=true) it fails, so a lost install shows."""
    why = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        why = "playwright (python) is not installed"
    if why is None and not Path(CHROMIUM).exists():
        why = f"{CHROMIUM} not found (apt-get install -y chromium)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def test_quick_run_from_the_ui_completes(stack):
    _browser_or_skip()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=30_000)  # two shared cores: the UI can be slow to settle
    RESULTS.mkdir(exist_ok=True)
    profile = tempfile.mkdtemp(prefix="rollart-chromium-")
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=ARGS,
                viewport={"width": 1400, "height": 1000})
            try:
                page = ctx.new_page()
                page.set_default_timeout(30_000)
                page.goto(stack.ui_url, wait_until="networkidle")
                page.get_by_role("link", name="Deployments", exact=True).click()
                page.locator("a[href*='/deployments/deployment/']").filter(
                    has_text=re.compile(r"^train$")).click()
                expect(page.get_by_text("flows.train:train")).to_be_visible()

                page.get_by_role("button", name="Run", exact=True).click()
                page.get_by_role("menuitem", name="Quick run").click()
                view = page.get_by_role("link", name="View run")
                expect(view).to_be_visible()
                flow_run_id = view.get_attribute("href").rstrip("/").rsplit("/", 1)[-1]
                view.click()

                fr = stack.wait_final(flow_run_id, timeout=360)
                assert fr.state.type.value == "COMPLETED", fr.state
                assert fr.parameters["overrides"][0] == "iterations=2"  # the deployment's own
                # The page follows the run by itself; reload once in case polling backed off.
                badge = page.get_by_text("Completed", exact=True).first
                try:
                    expect(badge).to_be_visible(timeout=20_000)
                except AssertionError:
                    page.reload(wait_until="networkidle")
                    expect(badge).to_be_visible()
                page.screenshot(path=str(RESULTS / "ui_quick_run.png"))

                page.get_by_role("tab", name="Artifacts").click()
                page.get_by_text(re.compile(r"-curves$")).first.click()  # the chart artifact
                chart = page.locator("img[src^='data:image/svg+xml']").first
                expect(chart).to_be_visible()
                width = chart.evaluate("img => img.complete ? img.naturalWidth : 0")
                assert width > 100, "the reward/success chart did not render"
                page.screenshot(path=str(RESULTS / "ui_artifacts.png"), full_page=True)
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
