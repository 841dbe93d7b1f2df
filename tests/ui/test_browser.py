"""The web UI in a real browser (Playwright + Debian's Chromium) against a live controller and a
real agent serving SmolLM2. Screenshots of each page land in test-artifacts/screenshots/."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import ROOT, Controller, start_agent, stop_agent, wait_for

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "test-artifacts" / "screenshots"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="Debian's chromium is not installed (/usr/bin/chromium): apt-get install -y chromium",
    ),
]


@pytest.fixture
def operator(transactional_db: None) -> str:
    """A staff user, made before the browser starts: Playwright's sync API runs an event loop in
    this thread, and Django refuses ORM calls from there."""
    from django.contrib.auth.hashers import make_password

    from tests.factories import UserFactory

    user = UserFactory(username="olga", is_staff=True)
    # The live controller checks passwords with the default hasher, not the tests' fast one.
    user.password = make_password("correct-horse-battery", hasher="pbkdf2_sha256")
    user.save(update_fields=["password"])
    return "olga"


@pytest.fixture
def browser_page(live: Controller, operator: str) -> Iterator[Any]:
    from playwright.sync_api import expect, sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            context = browser.new_context(
                viewport={"width": 1366, "height": 820}, base_url=live.url
            )
            page = context.new_page()
            # Generous: these machines run other suites alongside (load well above the core count).
            page.set_default_timeout(30_000)
            expect.set_options(timeout=30_000)
            page.on("dialog", lambda d: d.accept())  # hx-confirm / confirm(): the operator says yes
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.errors = errors  # type: ignore[attr-defined]
            yield page
        finally:
            browser.close()


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_an_operator_runs_the_cluster_from_the_browser(
    live: Controller, browser_page: Any, model_path: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    page = browser_page

    # Log in.
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/login/\?next=/$"))
    page.fill("input[name=username]", "olga")
    page.fill("input[name=password]", "correct-horse-battery")
    shot(page, "01-login")
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Dashboard")
    expect(page.locator("#live-dot.on")).to_be_visible()  # the dashboard socket is connected

    # Create an enrollment token and see the command line (once).
    page.goto("/tokens/")
    page.fill("input[name=label]", "browser-box")
    page.click("text=Create token")
    command = page.locator("#agent-command")
    expect(command).to_contain_text("node-agent --foreground --controller-url")
    token = re.search(r"RACON_ENROLLMENT_TOKEN=(\S+)", command.inner_text()).group(1)
    expect(page.locator("#token-table")).to_contain_text("browser-box")
    shot(page, "02-token-created")

    # A node appears in the live list and turns READY, without a reload.
    page.goto("/nodes/")
    expect(page.locator("#live-dot.on")).to_be_visible()
    page.evaluate("window.__noReload = true")
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    shutil.copy(model_path, models_dir / model_path.name)
    agent = start_agent(live, token, "web-1", tmp_path, models_dir=models_dir)
    try:
        row = page.locator("#node-rows tr", has_text="web-1")
        expect(row.locator(".badge")).to_have_text("READY", timeout=60_000)
        assert page.evaluate("window.__noReload") is True
        shot(page, "03-node-ready-live")

        # Register SmolLM2, preview its placement (a bar of 30 layer cells), deploy it.
        page.goto("/models/")
        page.fill("input[name=path]", str(model_path))
        page.fill("input[name=name]", "smollm2")
        page.click("#model-section button[type=submit]")
        expect(page.locator("#model-table")).to_contain_text(
            "SmolLM2-135M-Instruct.Q4_1.gguf", timeout=60_000
        )
        shot(page, "04-models")

        page.goto("/deployments/")
        page.fill("input[name=n_ctx]", "1024")
        page.check("label.chip:has-text('web-1') input")
        page.click("text=Preview placement")
        expect(page.locator("#preview .layer-bar .cell")).to_have_count(30)
        expect(page.locator("#predicted-tps")).not_to_be_empty()
        expect(page.locator("#preview .explanation li").first).to_be_visible()
        expect(page.locator("#preview .legend")).to_contain_text("web-1")
        shot(page, "05-placement-preview")
        page.click("#deploy-form button[type=submit]")
        dep_row = page.locator("#dep-rows tr", has_text="smollm2")
        expect(dep_row).to_be_visible()
        # The row's state changes arrive over the WebSocket (deployment.changed), no reload.
        expect(dep_row.locator(".badge")).to_have_text("READY", timeout=120_000)
        shot(page, "06-deployment-ready")

        # Chat in the playground and watch the tokens stream in.
        page.goto("/playground/")
        expect(page.locator("#pg-model")).to_contain_text("smollm2 (deployed)")
        page.fill("#pg-max-tokens", "24")
        page.fill("#pg-temperature", "0")
        page.evaluate(
            """() => {
              window.__updates = 0;
              window.__lengths = [];  // the answer's length at each update
              new MutationObserver(() => {
                window.__updates += 1;
                const body = document.querySelector('.msg-bubble.assistant .body');
                if (body) window.__lengths.push(body.textContent.length);
              })
                .observe(document.getElementById('pg-log'), {subtree: true, childList: true, characterData: true});
            }"""
        )
        page.fill("#pg-input", "Name three colours.")
        page.click("#pg-send")
        answer = page.locator(".msg-bubble.assistant .body")
        expect(answer).not_to_have_class(re.compile(r"typing"), timeout=60_000)
        expect(answer).not_to_be_empty()
        assert "⚠" not in answer.inner_text()
        # Streamed: the answer grew in several steps, not in one piece. (A fast stream's tokens
        # come a few per chunk, docs/design/serving.md "Coalescing": 24 tokens made 5 DOM updates.)
        grew = {n for n in page.evaluate("window.__lengths") if n}
        assert len(grew) >= 3, (grew, page.evaluate("window.__updates"))
        expect(page.locator("#pg-stats")).to_contain_text("tok/s")
        shot(page, "07-playground")

        # Jobs, the job's page with its replayed stream, credits.
        page.click("#pg-stats a")
        expect(page.locator("#token-stream")).not_to_be_empty(timeout=15_000)
        shot(page, "08-job-detail")
        page.goto("/jobs/")
        expect(page.locator("#job-table")).to_contain_text("COMPLETED")
        shot(page, "09-jobs")
        page.goto("/credits/")
        expect(page.locator("#balance")).not_to_be_empty()
        shot(page, "10-credits")
        page.goto("/")
        expect(page.locator("#node-rows")).to_contain_text("web-1")
        shot(page, "11-dashboard")

        # Drain the node from its page and see its state change.
        page.goto("/nodes/")
        page.click("#node-rows a:has-text('web-1')")
        expect(page.locator("[id^=node-badge-]")).to_have_text("READY")
        shot(page, "12-node-detail")
        page.click("button:has-text('Drain')")
        # DRAINING while its deployment moves or its jobs finish, then DRAINED.
        expect(page.locator("[id^=node-badge-]")).to_have_text(
            re.compile("^DRAIN(ING|ED)$"), timeout=15_000
        )
        expect(page.locator("button:has-text('Undrain')")).to_be_visible()
        shot(page, "13-node-draining")
        assert wait_for(
            lambda: [
                n for n in live.get("/api/admin/nodes?state=DRAINED").json() if n["name"] == "web-1"
            ],
            30,
            "the API to agree",
        )
        assert page.errors == [], page.errors  # no JavaScript errors on any page
    finally:
        stop_agent(agent)
