"""The dashboard in a real headless Chromium (Debian's chromium, driven by Python Playwright)
against a live uvicorn process on 127.0.0.1 with a seeded SQLite database: the plots render,
the table filters and paginates (with and without JavaScript), a problem page shows its plots,
no console errors, and no request goes to any host but the server.

Needs ``apt-get install chromium`` and ``pip install playwright`` (no browser download: the
system binary is used). Without them these tests skip, unless ``AUTOTUNER_REQUIRE_BROWSER=1``:
then they fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autotuner import Device, Problem, Strategy
from autotuner.tune.store import device_values, problem_values
from db import Database, upgrade
from db import repository as repo
from service.testing import HOST, ROOT, free_port, problem, stop_server, wait_healthy

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

CHROMIUM = Path(os.environ.get("AUTOTUNER_CHROMIUM", "/usr/lib/chromium/chromium"))
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
REQUIRE_ENV = "AUTOTUNER_REQUIRE_BROWSER"
TIMEOUT_MS = 20_000

DEV_A = Device("cpu", "cpu", 8, 1, "inproc", "0.10.2", "0.10.2")
DEV_B = Device("tpu", "TPU v4", 4, 4, "lab-ring-1gbit", "0.10.2", "0.10.2")
UNI = Strategy("ring", "uni", 1, "full", "loop", True)
BIDI = Strategy("ring", "bidi", 2, "full", "loop", True)
N_A, N_B = 40, 8
FAILURE = "ValueError: out_specs entry too long\n  while timing the collective alone"

BENCH_PAIR = {"names": ["layers/attn/q_proj"], "key": "ab" * 32, "strategy": "ring-bidi-c2-ufull-loop-send",
              "count": 2, "baseline_s": 0.004, "strategy_s": 0.003, "comm_s": 0.002, "comp_s": 0.0015,
              "ratio": 1.33, "ratio_lo": 1.2, "ratio_hi": 1.4, "failed": None, "saved_s": 0.002}
BENCH = {"program": "autotuner.examples.transformer:train_step", "kwargs": {"layers": 1},
         "target": "lab:shared:4:2gbit", "mesh": {"model": 4}, "strategy": "auto", "reps": 20,
         "plain_s": 0.020, "plain_lo_s": 0.019, "plain_hi_s": 0.0215, "overlapped_s": 0.016,
         "overlapped_lo_s": 0.0152, "overlapped_hi_s": 0.017, "speedup": 1.25, "speedup_lo": 1.18,
         "speedup_hi": 1.31, "slower": False, "rel_error": 1e-6, "pairs": [BENCH_PAIR], "comm_s": 0.004,
         "decomposed_comm_s": 0.004, "predicted_saved_s": 0.004, "host": "h"}
SLOWER = {**BENCH, "program": "autotuner.examples.transformer:example", "overlapped_s": 0.025,
          "overlapped_lo_s": 0.024, "overlapped_hi_s": 0.027, "speedup": 0.8, "speedup_lo": 0.74,
          "speedup_hi": 0.86, "slower": True, "pairs": []}

# The service app as `autotuner serve` builds it (create_app includes the dashboard).
SERVER = textwrap.dedent("""
    import sys, uvicorn
    from service.app import create_app
    app = create_app()
    uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), log_level="warning",
                access_log=False)
""")


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes")


def _unavailable(reason: str) -> None:
    if _required():
        pytest.fail(f"browser required ({REQUIRE_ENV}=1) but {reason}", pytrace=False)
    pytest.skip(f"no browser: {reason} (apt-get install chromium; pip install playwright)")


def _item(strategy: Strategy, median: float, ratio: float | None = None, status: str = "ok",
          reason: str | None = None) -> dict[str, Any]:
    if status != "ok":
        return {"strategy": strategy.to_dict(), "strategy_key": strategy.key, "status": status,
                "reason": reason}
    samples = [median * f for f in (0.95, 0.98, 1.0, 1.01, 1.06)]
    item = {"strategy": strategy.to_dict(), "strategy_key": strategy.key, "status": "ok",
            "samples": samples, "median_s": median, "iqr_s": median * 0.03, "n": 5}
    if ratio is not None:
        item.update(ratio=ratio, ratio_lo=ratio - 0.02, ratio_hi=ratio + 0.02)
    return item


def seed(url: str) -> dict[str, Any]:
    """N_A float32 problems on device A (every 6th won by the baseline, a failed trial on every
    4th), N_B bfloat16 reduce-scatter problems on device B."""
    database = Database(url)
    ids: dict[str, list[int]] = {"a": [], "b": []}
    try:
        with database.session() as s:
            da, db_ = (repo.upsert_device(s, **device_values(d)) for d in (DEV_A, DEV_B))
            for i in range(N_A):
                p = Problem.from_dict(problem(m=128 * (i + 1), k=256 * (1 + i % 4), n=256))
                rec = repo.upsert_problem(s, **problem_values(p))
                base, ratio = 1e-3 * (1 + i % 7), 0.95 if i % 6 == 0 else 1.04 + 0.015 * i
                items = [_item(Strategy("baseline"), base), _item(UNI, base / ratio, ratio),
                         _item(BIDI, base / (ratio - 0.03), ratio - 0.03)]
                if i % 4 == 0:
                    items.append(_item(Strategy("ring", "uni", 4, "full", "loop", True), 0,
                                       status="failed", reason="numerics: max error 0.3"))
                repo.record_measurements(s, da.id, rec.id, items)
                repo.recompute_winner(s, da.id, rec.id)
                ids["a"].append(rec.id)
            for i in range(N_B):
                p = Problem.from_dict(problem(m=256 * (i + 1), k=512, n=128, dtype="bfloat16",
                                              x=4, kind="rs"))
                rec = repo.upsert_problem(s, **problem_values(p))
                items = [_item(Strategy("baseline"), 2e-3), _item(BIDI, 2e-3 / 1.4, 1.4)]
                repo.record_measurements(s, db_.id, rec.id, items)
                repo.recompute_winner(s, db_.id, rec.id)
                ids["b"].append(rec.id)
            f = Problem.from_dict(problem(m=8192, k=128, n=128))   # tune failed on it (issue 14 item 2)
            rec = repo.upsert_problem(s, **problem_values(f, "layers/attn/q_proj"))
            repo.record_failure(s, da.id, rec.id, name="layers/attn/q_proj", error=FAILURE)
            ids["failed"] = [rec.id]
            ids["bench"] = [repo.record_model_bench(s, db_.id, **BENCH).id,   # issue 15 item 5
                            repo.record_model_bench(s, db_.id, **SLOWER).id]
            q = Problem.from_dict(problem(m=4096, k=128, n=128))
            repo.enqueue_job(s, problem_key=q.key, problem=q.canonical(), device_key=DEV_A.key,
                             device=DEV_A.to_dict())
    finally:
        database.dispose()
    return ids


@pytest.fixture(scope="module")
def playwright_browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} does not exist")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        _unavailable(f"the playwright package is not installed ({e})")
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS,
                                        headless=True)
        except Exception as e:  # a broken install: skip (or fail) with the reason
            _unavailable(f"chromium did not start: {e}")
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           playwright_browser: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("browser") / "autotuner.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    ids = seed(url)
    port = free_port()
    env = {**os.environ, "AUTOTUNER_DB_URL": url, "JAX_PLATFORMS": "cpu",
           "AUTOTUNER_WRITE_TOKENS": "browser-test-token"}
    env.pop("AUTOTUNER_READ_TOKENS", None)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, HOST, str(port)], env=env, cwd=ROOT,
                            start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        wait_healthy(proc, base)
        yield base, ids
    finally:
        stop_server(proc)


class Watched:
    """A page whose requests, console errors and uncaught exceptions are recorded."""

    def __init__(self, context: Any, base: str) -> None:
        self.base = base
        self.page = context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                     if m.type in ("error", "assert") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("requestfailed", lambda r: self.errors.append(f"failed: {r.url}"))

    def goto(self, path: str) -> Any:
        response = self.page.goto(self.base + path, wait_until="load")
        assert response is not None and response.status == 200, (path, response and response.status)
        return response

    def check(self) -> None:
        foreign = [u for u in self.requests
                   if not (u.startswith(self.base + "/") or u.startswith("data:"))]
        assert foreign == [], f"requests to other hosts: {foreign}"
        assert self.errors == [], self.errors


@pytest.fixture
def watched(playwright_browser: Any, server: tuple[str, dict[str, Any]]) -> Iterator[Watched]:
    context = playwright_browser.new_context(viewport={"width": 1400, "height": 1000})
    w = Watched(context, server[0])
    try:
        yield w
        w.check()
    finally:
        context.close()


def _traces(page: Any, fig_id: str) -> int:
    page.wait_for_selector(f"#{fig_id}[data-drawn='true'] .main-svg")
    return int(page.evaluate(f"document.getElementById('{fig_id}').data.length"))


def _row_ids(page: Any) -> list[int]:
    return [int(x) for x in page.eval_on_selector_all(
        "#problems tbody tr", "rows => rows.map(r => r.dataset.problem)")]


def test_overview_plots_render(watched, server):
    _, ids = server
    page = watched.page
    watched.goto("/")
    for fig in ("fig-speedups", "fig-shapes"):
        assert page.locator(f"#{fig}.js-plotly-plot, #{fig} .plotly").count() >= 1
        assert _traces(page, fig) >= 2  # several winning methods: one trace each
    assert page.locator("#fig-speedups .barlayer .point").count() > 0
    points = page.locator("#fig-shapes .scatterlayer .point")
    assert points.count() == N_A + N_B
    assert page.locator("#tuned tbody tr").count() == 2  # (device, pattern) rows
    assert "queued 1" in page.inner_text("#jobs")
    # a point of the shape map opens its problem
    box = points.first.bounding_box()
    assert box is not None
    with page.expect_navigation():
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    assert "/problems/" in page.url
    page.wait_for_selector("#json pre")


def test_overview_lists_failed_problems_with_their_error(watched, server):
    _, ids = server
    page = watched.page
    watched.goto("/")
    rows = page.locator("#failures tbody tr")
    assert rows.count() == 1
    text = rows.first.inner_text()
    assert "layers/attn/q_proj" in text and "ValueError: out_specs entry too long" in text
    assert "while timing the collective alone" in text
    with page.expect_navigation():
        rows.first.locator("a").click()
    assert page.url.endswith(f"/problems/{Problem.from_dict(problem(m=8192, k=128, n=128)).key}")
    assert "layers/attn/q_proj" in page.inner_text("h1")
    assert "ValueError: out_specs entry too long" in page.inner_text("#failures")


def test_table_filters_and_paginates(watched, server):
    _, ids = server
    page = watched.page
    watched.goto("/problems?per_page=25&sort=speedup")
    first = _row_ids(page)
    assert len(first) == 25
    assert "of 48" in page.inner_text("#count")
    page.click("a[rel=next]")
    page.wait_for_url("**&page=2&**")
    second = _row_ids(page)
    assert len(second) == 23 and not set(first) & set(second)
    page.click("a[rel=prev]")
    page.wait_for_url(lambda u: "&page=" not in u)  # page 1 is the default: left out
    assert _row_ids(page) == first

    page.select_option("select[name=dtype]", "bfloat16")
    page.click("#filters button[type=submit]")
    page.wait_for_url("**dtype=bfloat16**")
    assert sorted(_row_ids(page)) == sorted(ids["b"])
    dtypes = page.eval_on_selector_all("#problems tbody tr td:nth-child(5)",
                                       "cells => cells.map(c => c.textContent.trim())")
    assert set(dtypes) == {"bfloat16"}

    page.fill("input[name=q]", "no-such-equation")
    page.click("#filters button[type=submit]")
    page.wait_for_url("**q=no-such-equation**")
    assert page.locator("#problems").count() == 0
    assert "No tuned problem matches" in page.inner_text("#count")


def test_table_without_javascript(playwright_browser, server):
    base, ids = server
    context = playwright_browser.new_context(java_script_enabled=False)
    try:
        w = Watched(context, base)
        w.goto("/problems?per_page=10")
        page = w.page
        assert len(_row_ids(page)) == 10
        page.select_option("select[name=method]", "baseline")
        page.click("#filters button[type=submit]")
        page.wait_for_url("**method=baseline**")
        assert len(_row_ids(page)) == len(range(0, N_A, 6))
        page.click("th a:has-text('speedup')")
        page.wait_for_url("**sort=speedup**")
        assert "method=baseline" in page.url
        w.check()
    finally:
        context.close()


def test_problem_page_shows_its_plots(watched, server):
    _, ids = server
    page = watched.page
    context = page.context
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    problem_id = ids["a"][4]  # a winner, two more strategies, a failed trial
    watched.goto(f"/problems/{problem_id}")
    strategies = page.locator("div.plot[id^=fig-strategies-]")
    assert strategies.count() == 1
    fig = strategies.first.get_attribute("id")
    assert _traces(page, fig) == 3  # baseline, winner, the other strategy
    assert page.locator(f"#{fig} .errorbar").count() >= 3
    assert "not recorded" in page.inner_text(f"#{fig}")
    history = page.locator("div.plot[id^=fig-history-]").first.get_attribute("id")
    assert _traces(page, history) == 3  # trials, best so far, failed
    assert "numerics: max error 0.3" in page.inner_text("ul.failures")

    copy = page.locator("button.copy")
    assert copy.is_visible()
    copy.click()
    # A Python-side wait: wait_for_function evaluates its string with eval(), which the
    # dashboard's CSP (script-src 'self') forbids, as it should.
    from playwright.sync_api import expect

    expect(page.locator(".copied")).not_to_have_text("", timeout=TIMEOUT_MS)
    if page.inner_text(".copied") == "copied":
        copied = page.evaluate("navigator.clipboard.readText()")
        assert '"equation"' in copied and copied.strip() == page.inner_text("#problem-json").strip()


def test_models_page_shows_the_runs_and_a_runs_chart(watched, server):
    """Issue 15 item 5: the stored bench-model runs, the slower one flagged; a run's page draws
    plain vs overlapped with its interval whiskers and lists the per-pair breakdown."""
    _, ids = server
    page = watched.page
    watched.goto("/")
    with page.expect_navigation():
        page.click("header nav a:has-text('Models')")
    assert page.url.endswith("/models")
    rows = page.locator("#model-benches tbody tr")
    assert rows.count() == 2
    slow = page.locator(f"#model-benches tr[data-bench-id='{ids['bench'][1]}']")
    assert slow.locator(".flag-slower").is_visible() and "0.800×" in slow.inner_text()
    fast = page.locator(f"#model-benches tr[data-bench-id='{ids['bench'][0]}']")
    text = fast.inner_text()
    assert "train_step" in text and "1.250×" in text and "[1.180, 1.310]" in text
    assert fast.locator(".flag-slower").count() == 0
    with page.expect_navigation():
        fast.locator("a").first.click()
    assert page.url.endswith(f"/models/{ids['bench'][0]}")
    assert _traces(page, "fig-step") == 1
    assert page.locator("#fig-step .barlayer .point").count() == 2       # plain, overlapped
    assert page.locator("#fig-step .errorbar").count() == 2              # their interval whiskers
    assert "layers/attn/q_proj" in page.inner_text("#bench-pairs")
    assert _traces(page, "fig-pairs") == 4
