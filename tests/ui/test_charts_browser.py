"""The web UI's charts, names and views in a real browser (Playwright + Debian's Chromium) on the
session's live controller, with a contributor's real agent serving SmolLM2.

N requests go through /v1, the rollup is flushed with ``manage.py rollup_flush`` (what beat runs
every minute), and the charts' series read back from the page hold those N requests and the
controller's own token count; one more request and flush arrive over the WebSocket without a
reload. Every page is opened as the operator and as the contributor: no bare id where a name
exists, no JavaScript error, no COOP header on plain http. Screenshots land in
test-artifacts/screenshots/ (the README's come from here: docs/img/).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import BIN, ROOT, Controller, start_agent, stop_agent, wait_for
from tests.support.unavailable import unavailable

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "test-artifacts" / "screenshots"
DOC_IMG = ROOT / "test-artifacts" / "docs-img"
N = 3
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
PASSWORD = "correct-horse-battery"

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def chromium() -> Path:
    if not CHROMIUM.exists():
        unavailable(
            "Debian's chromium is not installed (/usr/bin/chromium): scripts/install-chromium.sh",
            under_ci="(run by make test) did not install it",
        )
    return CHROMIUM


def _people(transactional_db: None) -> dict[str, Any]:
    """The operator and a contributor with passwords the live controller checks (its default hasher)."""
    from django.contrib.auth.hashers import make_password

    from apps.credits.ledger import account_for_user
    from tests.factories import UserFactory

    out: dict[str, Any] = {}
    for name, staff in (("olga", True), ("carl", False)):
        user = UserFactory(username=name, is_staff=staff)
        user.password = make_password(PASSWORD, hasher="pbkdf2_sha256")
        user.save(update_fields=["password"])
        out[name] = str(account_for_user(user=user).id)
    return out


def _flush(live: Controller) -> None:
    """What beat does every ROLLUP_PERIOD_SECONDS, now: the live controller's own command."""
    env = {k: v for k, v in live.env.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [str(BIN / "python"), "manage.py", "rollup_flush"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _chat(live: Controller, text: str) -> dict[str, Any]:
    resp = httpx.post(
        live.url + "/v1/chat/completions",
        headers=live.headers(),
        json={
            "model": "smollm2-ui",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=180,
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _series_sum(page: Any, chart: str, label: str) -> float:
    """The sum of one line of a drawn chart: uPlot's own data (what it draws), by series label."""
    return float(
        page.evaluate(
            """([chart, label]) => {
              const c = window.raconCharts && window.raconCharts[chart];
              if (!c) return -1;
              const i = c.plot.series.findIndex(s => s.label === label);
              if (i < 1) return -2;
              return c.plot.data[i].reduce((a, v) => a + (v || 0), 0);
            }""",
            [chart, label],
        )
    )


def _visible_text_without_ids(page: Any) -> str:
    """The page's text, less the one place a raw id is the point (a node's Identity card)."""
    return str(
        page.evaluate(
            """() => { const m = document.querySelector('main').cloneNode(true);
                       m.querySelectorAll('[data-raw-id], script, template').forEach(e => e.remove());
                       return m.innerText; }"""
        )
    )


LOAD_TIMES: dict[str, float] = {}


def _open(page: Any, path: str, name: str, errors: list[str]) -> None:
    started = time.monotonic()
    resp = page.goto(path)
    assert resp is not None and resp.status == 200, f"{path}: {resp and resp.status}"
    # Plain http: no Cross-Origin-Opener-Policy (a browser ignores it there and logs an error).
    assert "cross-origin-opener-policy" not in {k.lower() for k in resp.headers}, path
    page.wait_for_load_state("networkidle")
    # Figures for the closing note (never asserted: this machine runs other suites alongside).
    LOAD_TIMES[name] = round(time.monotonic() - started, 2)
    print(f"[ui] {name}: {path} loaded in {LOAD_TIMES[name]:.2f} s")
    text = _visible_text_without_ids(page)
    bare = [text[max(0, m.start() - 80) : m.end() + 20] for m in UUID.finditer(text)]
    assert not bare, f"{path} shows bare ids where names exist: {bare[:3]}"
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    assert errors == [], f"{path}: {errors}"


def test_charts_names_and_views_for_an_operator_and_a_contributor(
    live: Controller, chromium: Path, transactional_db: None, model_path: Path, tmp_path: Path
) -> None:
    from django.db.models import Sum

    from apps.credits.models import Receipt
    from apps.jobs.models import Job

    accounts = _people(transactional_db)
    SHOTS.mkdir(parents=True, exist_ok=True)
    DOC_IMG.mkdir(parents=True, exist_ok=True)

    # The contributor's machine: a token of carl's account, a real agent, SmolLM2 pinned to it.
    tok = live.post("/api/admin/tokens", {"label": "carl-box", "account": accounts["carl"]})
    assert tok.status_code == 201, tok.text
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    shutil.copy(model_path, models_dir / model_path.name)
    agent = start_agent(live, tok.json()["token"], "carl-box", tmp_path, models_dir=models_dir)
    try:
        node = wait_for(
            lambda: next(
                (
                    n
                    for n in live.get("/api/admin/nodes?state=READY").json()
                    if n["name"] == "carl-box"
                ),
                None,
            ),
            90,
            "carl-box READY",
        )
        created = live.post("/api/admin/models", {"path": str(model_path), "name": "smollm2-ui"})
        assert created.status_code == 201, created.text
        dep = live.post(
            "/api/admin/deployments", {"model": "smollm2-ui", "nodes": ["carl-box"], "n_ctx": 1024}
        )
        assert dep.status_code == 202, dep.text

        def dep_ready() -> bool:
            got = live.get(f"/api/admin/deployments/{dep.json()['id']}").json()
            assert got["state"] not in ("FAILED", "STOPPED"), (got, agent.log()[-3000:])
            return bool(got["state"] == "READY")

        wait_for(dep_ready, 600, "the deployment READY")

        # N requests; the controller's own count of what they generated; settled (carl earns).
        for i in range(N):
            _chat(live, f"Count to {i + 3}.")
        jobs = Job.objects.filter(model__name="smollm2-ui", state="COMPLETED")
        assert jobs.count() == N
        tokens = int(jobs.aggregate(t=Sum("completion_tokens"))["t"] or 0)
        assert tokens > 0
        wait_for(lambda: Receipt.objects.filter(node_id=node["id"]).count() >= N, 60, "N receipts")
        earned = int(Receipt.objects.filter(node_id=node["id"]).aggregate(c=Sum("credits"))["c"])
        job_id = str(jobs.first().id)
        _flush(live)

        from playwright.sync_api import expect, sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=str(chromium),
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

                def sign_in(user: str) -> tuple[Any, list[str]]:
                    ctx = browser.new_context(
                        viewport={"width": 1366, "height": 900}, base_url=live.url
                    )
                    page = ctx.new_page()
                    page.set_default_timeout(30_000)
                    expect.set_options(timeout=30_000)
                    errors: list[str] = []
                    page.on("pageerror", lambda exc: errors.append(str(exc)))
                    page.on(
                        "console",
                        lambda msg: (
                            errors.append(msg.text)
                            if msg.type == "error" and "Cross-Origin-Opener-Policy" in msg.text
                            else None
                        ),
                    )
                    page.goto("/login/")
                    page.fill("input[name=username]", user)
                    page.fill("input[name=password]", PASSWORD)
                    page.click("button[type=submit]")
                    expect(page.locator("h1")).to_have_text("Dashboard")
                    return page, errors

                # --- the operator ---------------------------------------------------------------
                page, errors = sign_in("olga")
                expect(page.locator("#live-dot.on")).to_be_visible()
                page.wait_for_function(
                    "() => window.raconCharts && window.raconCharts['requests-model']"
                )
                assert _series_sum(page, "requests-model", "smollm2-ui") == N
                assert round(_series_sum(page, "tokens-model", "smollm2-ui") * 60) == tokens
                assert _series_sum(page, "requests-node", "carl-box") == N
                assert page.evaluate("window.raconCharts['ttft'].plot.data[1].some(v => v > 0)")
                share = page.evaluate(
                    "window.raconCharts['layer-share'].plot.series.map(s => s.label)"
                )
                assert "carl-box (100.0%)" in share, share
                # Live: one more request and a rollup reach the open page over the socket.
                page.evaluate("window.__noReload = true")
                _chat(live, "One more, please.")
                _flush(live)
                page.wait_for_function(
                    """(n) => { const c = window.raconCharts['requests-model'];
                                const i = c.plot.series.findIndex(s => s.label === 'smollm2-ui');
                                return i > 0 && c.plot.data[i].reduce((a, v) => a + (v || 0), 0) === n; }""",
                    arg=N + 1,
                )
                assert page.evaluate("window.__noReload") is True
                # The day window, asked for over the same socket.
                page.select_option("#chart-window", "day")
                page.wait_for_function(
                    "() => window.raconCharts['requests-model'].payload.step === 600"
                )
                assert _series_sum(page, "requests-model", "smollm2-ui") == N + 1
                page.select_option("#chart-window", "hour")
                # Events name the model and the nodes, and filter by kind and node.
                feed = page.locator("#event-feed")
                expect(feed.locator(".feed-item[data-kind=JOBS]").first).to_contain_text(
                    "smollm2-ui"
                )
                expect(feed.locator(".feed-item[data-kind=JOBS] .node-link").first).to_have_text(
                    "carl-box"
                )
                page.select_option("#event-feed select[name=kind]", "states")
                expect(feed.locator(".feed-item[data-kind=JOBS]")).to_have_count(0)
                page.screenshot(path=str(DOC_IMG / "dashboard.png"), full_page=False)
                _open(page, "/", "ui32-op-dashboard", errors)

                pages = [
                    "/nodes/",
                    f"/nodes/{node['id']}/",
                    "/nodes/links/",
                    "/tokens/",
                    "/models/",
                    "/deployments/",
                    "/accounts/",
                    "/jobs/",
                    f"/jobs/{job_id}/",
                    "/events/",
                    "/credits/",
                    "/credits/earnings/",
                    "/keys/",
                    "/playground/",
                ]
                for i, path in enumerate(pages):
                    _open(
                        page,
                        path,
                        f"ui32-op-{i:02d}-{path.strip('/').replace('/', '-')[:40] or 'root'}",
                        errors,
                    )
                    if path == f"/nodes/{node['id']}/":
                        page.wait_for_function(
                            "() => window.raconCharts && window.raconCharts['requests-node']"
                        )
                        assert _series_sum(page, "requests-node", "carl-box") == N + 1
                        assert page.evaluate(
                            "window.raconCharts['load'].plot.data[1].some(v => v != null)"
                        )
                    if path == "/deployments/":
                        row = page.locator("#dep-rows tr", has_text="smollm2-ui").first
                        expect(row.locator("a", has_text="carl-box")).to_be_visible()
                        expect(row.locator("td.tps")).to_contain_text("measured")
                    if path == f"/jobs/{job_id}/":
                        expect(page.locator("#served-by a", has_text="carl-box")).to_be_visible()
                    if path == "/credits/":
                        options = page.locator("select[name=account] option").all_inner_texts()
                        assert "system:operator" in options
                        assert not [
                            o
                            for o in options
                            if o in ("system:escrow", "system:mint", "system:holds", "system:fees")
                        ], options
                # The playground says which node and layers served its answer.
                page.goto("/playground/")
                page.fill("#pg-max-tokens", "8")
                page.fill("#pg-temperature", "0")
                page.select_option("#pg-model", "smollm2-ui")
                page.fill("#pg-input", "Say hi.")
                page.click("#pg-send")
                expect(page.locator("#pg-served a", has_text="carl-box")).to_be_visible(
                    timeout=120_000
                )
                page.screenshot(path=str(SHOTS / "ui32-op-playground-served.png"), full_page=True)
                assert errors == [], errors

                # --- the contributor ------------------------------------------------------------
                page, errors = sign_in("carl")
                page.wait_for_function(
                    "() => window.raconCharts && window.raconCharts['requests-node']"
                )
                assert _series_sum(page, "requests-node", "carl-box") >= N + 1
                machines = page.locator("#machine-rows tr", has_text="carl-box")
                expect(machines).to_contain_text("smollm2-ui")
                expect(page.locator("#standing")).to_contain_text("rank")
                got = _series_sum(page, "earnings", "carl-box")
                assert got * 1_000_000 >= earned > 0, (got, earned)
                _open(page, "/", "ui32-contrib-dashboard", errors)
                for i, path in enumerate(
                    [
                        "/nodes/",
                        f"/nodes/{node['id']}/",
                        "/jobs/",
                        f"/jobs/{job_id}/",
                        "/events/",
                        "/credits/",
                        "/credits/earnings/",
                        "/keys/",
                        "/playground/",
                    ]
                ):
                    _open(
                        page,
                        path,
                        f"ui32-contrib-{i:02d}-{path.strip('/').replace('/', '-')[:40]}",
                        errors,
                    )
                page.goto("/credits/earnings/")
                page.wait_for_function("() => window.raconCharts && window.raconCharts['earnings']")
                assert _series_sum(page, "earnings", "carl-box") * 1_000_000 >= earned
                page.screenshot(path=str(DOC_IMG / "contributor-earnings.png"), full_page=False)
                assert (
                    page.locator("select[name=account]").count() == 0
                )  # a contributor has no picker
                assert errors == [], errors
            finally:
                browser.close()
        # The WebSocket path logged no traceback (a slow Redis is one retried line).
        ws_traceback = re.search(
            r"Traceback[\s\S]{0,4000}?(apps/api/consumers\.py|channels_redis)", live.logs()
        )
        assert ws_traceback is None, (
            live.logs()[ws_traceback.start() : ws_traceback.start() + 3000] if ws_traceback else ""
        )
    finally:
        stop_agent(agent)
