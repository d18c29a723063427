"""The dashboard's models pages (issue 15 item 5): stored bench-model runs in a table with a
visible "slower" flag, and a run's page with the plain vs overlapped chart (interval whiskers)
and the per-pair breakdown; escaped, 404 for an unknown run, linked from the nav and overview."""

from __future__ import annotations

import html
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.exceptions import StarletteDeprecationWarning

from autotuner import Device
from autotuner.settings import Settings
from autotuner.tune.store import device_values
from db import Database, upgrade
from db import repository as repo
from service import create_app

from .test_dashboard import EVIL, figure, with_dashboard

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

DEV = Device("cpu", "cpu", 4, 4, "lab-shared-2gbit", "0.10.2", "0.10.2")
PAIR = {"names": ["layers/attn/q_proj", "layers/mlp/up_proj"], "key": "ab" * 32,
        "strategy": "ring-uni-c1-u1-loop-send", "count": 2, "baseline_s": 0.004, "strategy_s": 0.003,
        "comm_s": 0.002, "comp_s": 0.0015, "ratio": 1.33, "ratio_lo": 1.2, "ratio_hi": 1.4, "failed": None,
        "saved_s": 0.002}
FAILED = {**PAIR, "key": "cd" * 32, "strategy": "baseline", "count": 1, "strategy_s": None, "ratio": None,
          "ratio_lo": None, "ratio_hi": None, "saved_s": None, "failed": "RuntimeError: " + EVIL}


ATTRIBUTION = [{"key": "ab" * 32, "name": EVIL, "count": 2, "isolated_saved_s": 0.002, "alone_saved_s": 0.003,
                "alone_lo_s": 0.0025, "alone_hi_s": 0.0035, "without_saved_s": 0.0032, "without_lo_s": 0.0028,
                "without_hi_s": 0.0036}]


def bench(**kw: Any) -> dict[str, Any]:
    values = {"program": "autotuner.examples.transformer:train_step", "kwargs": {"layers": 1},
              "target": "lab:shared:4:2gbit", "mesh": {"model": 4}, "strategy": "auto", "reps": 20,
              "plain_s": 0.020, "plain_lo_s": 0.019, "plain_hi_s": 0.0215,
              "overlapped_s": 0.016, "overlapped_lo_s": 0.0152, "overlapped_hi_s": 0.017,
              "speedup": 1.25, "speedup_lo": 1.18, "speedup_hi": 1.31, "slower": False, "rel_error": 1e-6,
              "pairs": [PAIR, FAILED], "comm_s": 0.008, "decomposed_comm_s": 0.004, "predicted_saved_s": 0.004,
              "host": "h", "attribution": ATTRIBUTION}
    return {**values, **kw}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int]]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('models') / 'autotuner.db'}"
    upgrade(url)
    database = Database(url)
    with database.session() as s:
        dev = repo.upsert_device(s, **device_values(DEV))
        fast = repo.record_model_bench(s, dev.id, **bench())
        slow = repo.record_model_bench(s, dev.id, **bench(
            program="evil.mod:f", kwargs={"note": EVIL}, mesh=None, target="inproc:4",
            strategy="ring-bidi-c2-ufull-loop-send", overlapped_s=0.025, overlapped_lo_s=0.024,
            overlapped_hi_s=0.027, speedup=0.8, speedup_lo=0.74, speedup_hi=0.86, slower=True,
            predicted_saved_s=-0.001, pairs=[], attribution=None))
    database.dispose()
    yield url, {"fast": fast.id, "slow": slow.id}


@pytest.fixture(scope="module")
def client(seeded: tuple[str, dict[str, int]]) -> Iterator[TestClient]:
    app = with_dashboard(create_app(Settings(db_url=seeded[0])))
    with TestClient(app) as c:
        yield c


def table_rows(page: str) -> dict[int, str]:
    table = re.search(r'<table class="data" id="model-benches">(.*?)</table>', page, re.S)
    assert table is not None
    return {int(i): html.unescape(re.sub(r"<[^>]+>", " ", body))
            for i, body in re.findall(r'<tr data-bench-id="(\d+)"[^>]*>(.*?)</tr>', table.group(1), re.S)}


def test_models_table_lists_runs_and_flags_the_slower_one(client, seeded):
    ids = seeded[1]
    r = client.get("/models")
    assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    rows = table_rows(r.text)
    assert list(rows) == [ids["slow"], ids["fast"]]  # newest first
    fast, slow = (" ".join(rows[ids[k]].split()) for k in ("fast", "slow"))
    assert "autotuner.examples.transformer:train_step" in fast and "lab:shared:4:2gbit" in fast
    assert "cpu ×4 · lab-shared-2gbit" in fast
    assert "20.00 ms [19.00, 21.50]" in fast and "16.00 ms [15.20, 17.00]" in fast
    assert "1.250× [1.180, 1.310]" in fast and "slower" not in fast
    assert "0.800× [0.740, 0.860]" in slow and slow.count("slower") == 1
    assert re.search(rf'<tr data-bench-id="{ids["slow"]}" class="slower">', r.text)
    assert EVIL not in r.text and "&lt;script&gt;alert(" in r.text  # the kwargs shown, escaped
    assert '<a href="/models" aria-current="page">Models</a>' in r.text


def test_a_runs_page_has_the_chart_and_the_breakdown(client, seeded):
    ids = seeded[1]
    page = client.get(f"/models/{ids['fast']}").text
    fig = figure(page, "fig-step")
    (bars,) = fig["data"]
    assert bars["type"] == "bar" and bars["x"] == ["plain jit", "overlapped"]
    assert bars["y"] == pytest.approx([20.0, 16.0])
    assert bars["error_y"]["array"] == pytest.approx([1.5, 1.0])        # hi - median, ms
    assert bars["error_y"]["arrayminus"] == pytest.approx([1.0, 0.8])   # median - lo, ms
    assert "1.250× [1.180, 1.310]" in fig["layout"]["title"]["text"]
    pairs = re.search(r'<table class="data" id="bench-pairs">(.*?)</table>', page, re.S)
    assert pairs is not None
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", pairs.group(1))).split())
    assert "layers/attn/q_proj, layers/mlp/up_proj" in text and "ring-uni-c1-u1-loop-send" in text
    assert "4.00 ms 3.00 ms 1.33 [1.20, 1.40] 2.00 ms 1.50 ms 2.00 ms" in text
    assert "RuntimeError: " + EVIL in text and EVIL not in page  # escaped where shown
    summary = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page.split('id="bench-summary"')[1]
                                            .split("</table>")[0])).split())
    assert "8.00 ms (40% of the plain step)" in summary
    assert "predicted from the pairs alone 4.00 ms, measured 4.00 ms" in summary
    pair_fig = figure(page, "fig-pairs")
    assert [t["name"] for t in pair_fig["data"]] == ["baseline", "decomposed", "collective alone", "einsum alone"]
    att = re.search(r'<table class="data" id="bench-attribution">(.*?)</table>', page, re.S)
    assert att is not None
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", att.group(1))).split())
    assert EVIL + " 2 2.00 ms 3.00 ms [2.50, 3.50] 3.20 ms [2.80, 3.60]" in text
    assert "sums (measured saving 4.00 ms) 2.00 ms 3.00 ms 3.20 ms" in text


def test_a_slower_run_without_pairs_and_unknown_runs(client, seeded):
    page = client.get(f"/models/{seeded[1]['slow']}").text
    assert "The overlapped step is slower than plain jit beyond the 95% interval" in page
    assert "SLOWER" in figure(page, "fig-step")["layout"]["title"]["text"]
    assert "No per-pair breakdown stored" in page and 'id="fig-pairs"' not in page
    assert "No attribution stored" in page and 'id="bench-attribution"' not in page
    assert "· mesh the factory's own" in html.unescape(page)
    assert "measured -5.00 ms" in page and "predicted from the pairs alone -1.00 ms" in page
    for ref in ("999999", "abc", "1e3", "-1", "9" * 40):
        r = client.get(f"/models/{ref}")
        assert r.status_code == 404 and "No such benchmark run" in r.text


def test_the_overview_links_the_models_page_and_an_empty_database(client, sqlite_url):
    assert 'href="/models"' in client.get("/").text
    app = with_dashboard(create_app(Settings(db_url=sqlite_url)))
    with TestClient(app) as c:
        page = c.get("/models").text
        assert "No benchmark stored yet" in page and "autotuner bench-model" in page
