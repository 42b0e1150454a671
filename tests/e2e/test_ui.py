"""Browser test: headless Debian Chromium opens the Prefect UI of the stack, finds the `train`
deployment, starts a run with the UI's own "Run > Quick run", follows it to Completed and looks
at its artifacts (the reward/success chart must render as an image). Screenshots go to
results/ (ui_quick_run.png, ui_artifacts.png)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
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


def _train_run_ids(stack) -> set[str]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with stack.client() as c:
        runs = c.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["train"])))
    return {str(r.id) for r in runs}


def _new_train_run(stack, before: set[str], timeout: float = 45.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = _train_run_ids(stack) - before
        if new:
            return sorted(new)[0]
        time.sleep(1.0)
    return None


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
                # The server requires basic auth: what the UI's login page stores once the user
                # typed the auth string (`prefect-password`, base64), set before any page loads.
                ctx.add_init_script("localStorage.setItem('prefect-password', "
                                    f"btoa({json.dumps(stack.auth)}))")
                page = ctx.new_page()
                page.set_default_timeout(30_000)
                page.goto(stack.ui_url, wait_until="networkidle")
                page.get_by_role("link", name="Deployments", exact=True).click()
                page.locator("a[href*='/deployments/deployment/']").filter(
                    has_text=re.compile(r"^train$")).click()
                expect(page.get_by_text("flows.train:train")).to_be_visible()

                # The run is found through the API rather than the UI's short-lived toast, which
                # a slow page can miss; a lost menu click is retried once.
                before = _train_run_ids(stack)
                flow_run_id = None
                for _ in range(2):
                    page.get_by_role("button", name="Run", exact=True).click()
                    page.get_by_role("menuitem", name="Quick run").click()
                    flow_run_id = _new_train_run(stack, before)
                    if flow_run_id:
                        break
                assert flow_run_id, "the UI's Quick run created no flow run"
                page.goto(f"{stack.ui_url}/runs/flow-run/{flow_run_id}",
                          wait_until="networkidle")

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

                tab = page.get_by_role("tab", name=re.compile(r"^Artifacts"))
                if tab.count() == 0:  # some UI builds render the tab list as plain buttons
                    tab = page.get_by_text("Artifacts", exact=True)
                tab.first.click()
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
