"""The dashboard (service.dashboard) through FastAPI's TestClient on a seeded SQLite database:
every page renders what the database holds, the table filters/sorts/paginates on the server,
everything is escaped, bad parameters give 4xx pages, plotly.js is served locally."""

from __future__ import annotations

import gzip
import html
import json
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.exceptions import StarletteDeprecationWarning

from autotuner import Device, Problem, Strategy
from autotuner.settings import Settings
from autotuner.tune.store import device_values, problem_values
from db import Database
from db import repository as repo
from service import create_app, dashboard
from service.dashboard import views
from service.dashboard.assets import Assets
from service.testing import READ_HEADERS, READ_TOKEN, WRITE_TOKEN, problem

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

EVIL = '<script>alert("kind")</script>'
DEV_A = Device("cpu", "cpu", 8, 1, "inproc", "0.10.2", "0.10.2")
DEV_B = Device("cpu", EVIL, 4, 4, "lab-ring-1gbit", "0.10.2", "0.10.2")
UNI = Strategy("ring", "uni", 1, "full", "loop", True)
BIDI = Strategy("ring", "bidi", 2, "full", "loop", True)
BASE = Strategy("baseline")
N_A, N_B = 30, 6


def with_dashboard(app: Any) -> Any:
    """The service app with the dashboard's routes (once create_app includes them, as is)."""
    if not any(getattr(r, "path", None) == "/problems" for r in app.routes):
        app.include_router(dashboard.router)
    return app


def _item(strategy: Strategy, median: float, *, ratio: float | None = None, status: str = "ok",
          reason: str | None = None) -> dict[str, Any]:
    if status != "ok":
        return {"strategy": strategy.to_dict(), "strategy_key": strategy.key, "status": status,
                "reason": reason}
    samples = [median * f for f in (0.96, 0.98, 1.0, 1.02, 1.04)]
    item: dict[str, Any] = {"strategy": strategy.to_dict(), "strategy_key": strategy.key,
                            "status": "ok", "samples": samples, "median_s": median,
                            "iqr_s": median * 0.04, "min_s": min(samples), "n": len(samples),
                            "compile_s": 0.5}
    if ratio is not None:
        item.update(ratio=ratio, ratio_lo=ratio - 0.02, ratio_hi=ratio + 0.02)
    return item


def seed(database: Database) -> dict[str, Any]:
    """Device A: N_A all-gather problems (every 5th won by the baseline, every 4th by the
    bidirectional ring, a failed bidirectional trial on every 3rd); device B (its kind is a
    script tag): N_B reduce-scatter problems in bfloat16. One queued job."""
    info: dict[str, Any] = {"a": [], "b": []}
    with database.session() as s:
        da, db_ = (repo.upsert_device(s, **device_values(d)) for d in (DEV_A, DEV_B))
        info["device_a"], info["device_b"] = da, db_
        for i in range(N_A):
            p = Problem.from_dict(problem(m=256 * (i + 1), k=512, n=128 * (1 + i % 3)))
            rec = repo.upsert_problem(s, **problem_values(p))
            base = 1e-3 * (i + 1)
            ratio = 0.9 if i % 5 == 0 else 1.05 + 0.02 * i
            items = [_item(BASE, base), _item(UNI, base / ratio, ratio=ratio)]
            if i % 4 == 1:
                items.append(_item(BIDI, base / (ratio + 0.1), ratio=ratio + 0.1))
            if i % 3 == 0:
                items.append(_item(BIDI, 0, status="failed",
                                   reason="RESOURCE_EXHAUSTED: </pre><b>out of memory</b>"))
            repo.record_measurements(s, da.id, rec.id, items)
            repo.recompute_winner(s, da.id, rec.id)
            info["a"].append(rec)
        for i in range(N_B):
            p = Problem.from_dict(problem(m=512 * (i + 1), k=1024, n=256, dtype="bfloat16",
                                          x=4, kind="rs"))
            rec = repo.upsert_problem(s, **problem_values(p))
            # the ring timed beside its serial control: 1.3 = traffic 1.1 x overlap 1.3 / 1.1
            items = [_item(BASE, 2e-3), {**_item(UNI, 2e-3 / 1.3, ratio=1.3), "traffic_speedup": 1.1,
                                         "serial_s": 2e-3 / 1.1}]
            repo.record_measurements(s, db_.id, rec.id, items)
            repo.recompute_winner(s, db_.id, rec.id)
            info["b"].append(rec)
        queued = Problem.from_dict(problem(m=8192, k=64, n=64))
        repo.enqueue_job(s, problem_key=queued.key, problem=queued.canonical(),
                         device_key=DEV_A.key, device=DEV_A.to_dict(), priority=3)
    return info


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    from db import upgrade

    path = tmp_path_factory.mktemp("dashboard") / "autotuner.db"
    upgrade(f"sqlite:///{path}")
    database = Database(f"sqlite:///{path}")
    info = seed(database)
    database.dispose()
    yield f"sqlite:///{path}", info


@pytest.fixture(scope="module")
def client(seeded: tuple[str, dict[str, Any]]) -> Iterator[TestClient]:
    url, _ = seeded
    app = with_dashboard(create_app(Settings(db_url=url, write_tokens=[WRITE_TOKEN])))
    with TestClient(app) as c:
        yield c


@pytest.fixture
def info(seeded: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return seeded[1]


def figure(page: str, fig_id: str) -> dict[str, Any]:
    m = re.search(rf'<script type="application/json" id="{re.escape(fig_id)}-data">(.*?)</script>',
                  page, re.S)
    assert m, f"no figure {fig_id}"
    return json.loads(m.group(1))  # type: ignore[no-any-return]


def rows(page: str) -> list[dict[str, str]]:
    """The problems table's rows as {column: text}."""
    table = re.search(r'<table class="data" id="problems">(.*?)</table>', page, re.S)
    if table is None:
        return []
    heads = [re.sub(r"<[^>]+>|[▲▼]", "", h).strip()
             for h in re.findall(r"<th[^>]*>(.*?)</th>", table.group(1), re.S)]
    out = []
    for tr in re.findall(r'<tr data-problem="(\d+)">(.*?)</tr>', table.group(1), re.S):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip()
                 for c in re.findall(r"<td[^>]*>(.*?)</td>", tr[1], re.S)]
        out.append({"id": tr[0], **dict(zip(heads, cells, strict=True))})
    return out


def expected(database_url: str, **kw: Any) -> list[int]:
    database = Database(database_url)
    try:
        with database.session(read_only=True) as s:
            return [r.problem.id for r in repo.list_problems(s, **kw).items]
    finally:
        database.dispose()


# --------------------------------------------------------------------------- overview


def test_overview(client, info):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    page = r.text
    assert f"<strong>{N_A + N_B}</strong> tuned" in page
    decomposed_a = sum(1 for i in range(N_A) if i % 5 != 0)
    assert re.search(rf'all_gather:lhs:free</a></td>\s*<td class="num">{N_A}</td>\s*'
                     rf'<td class="num">{decomposed_a}</td>', page)
    assert re.search(rf'reduce_scatter:free_lhs</a></td>\s*<td class="num">{N_B}</td>', page)

    hist = figure(page, "fig-speedups")
    assert sum(sum(t["y"]) for t in hist["data"]) == N_A + N_B
    assert {t["name"] for t in hist["data"]} == {"baseline", "ring-uni", "ring-bidi"}
    shapes = figure(page, "fig-shapes")
    assert sum(len(t["x"]) for t in shapes["data"]) == N_A + N_B
    assert shapes["layout"]["xaxis"]["type"] == "log" and shapes["layout"]["yaxis"]["type"] == "log"
    ids = {c[0] for t in shapes["data"] for c in t["customdata"]}
    assert ids == {p.id for p in info["a"] + info["b"]}

    # the job queue and the local-only assets
    assert "queued 1" in page and "8192/x×64" in page
    assert 'src="/static/plotly.min.js?v=' in page
    for url in re.findall(r'(?:src|href|action)="([^"]*)"', page):
        assert url.startswith(("/", "?", "data:")), url


def test_overview_device_filter(client):
    page = client.get("/", params={"device": DEV_B.key}).text
    hist = figure(page, "fig-speedups")
    assert sum(sum(t["y"]) for t in hist["data"]) == N_B
    assert sum(len(t["x"]) for t in figure(page, "fig-shapes")["data"]) == N_B
    assert client.get("/", params={"device": "nope"}).status_code == 200  # no such device: empty
    assert "No winners yet" in client.get("/", params={"device": "nope"}).text


def test_overview_lookups_and_demand(client, info):
    tuned = info["a"][3].canonical
    untuned = problem(m=4096, k=96, n=96)
    for p in (tuned, tuned, untuned):
        assert client.post("/v1/lookup", json={"device": DEV_A.to_dict(), "problem": p}).status_code == 200
    client.app.state.autotuner.lookups.demand.flush()   # what the background writer does every 0.5 s
    page = client.get("/").text
    shares = dict(re.findall(r'<tr><td>(\w+)</td><td class="num">(\d+)</td>', page))
    assert int(shares["tuned"]) >= 2 and int(shares["default"]) + int(shares["nearest"]) \
        + int(shares["model"]) >= 1
    lookups = figure(page, "fig-lookups")
    assert lookups["data"][0]["y"][:len(views.LOOKUP_SOURCES)] == list(views.LOOKUP_SOURCES)
    # the miss was written to the demand table and is listed as open demand
    assert "4096/x×96 · 96×96" in page


def test_lookup_shares_reads_the_counter():
    from service.metrics import Metrics

    m = Metrics()
    m.count_lookups({"tuned": 3, "nearest": 1, "brand_new": 2})
    assert views.lookup_shares(m.registry) == {"tuned": 3.0, "estimated": 0.0, "nearest": 1.0, "model": 0.0,
                                               "default": 0.0, "brand_new": 2.0}


# --------------------------------------------------------------------------- table


def test_table_default_page(client, seeded):
    url, _ = seeded
    r = client.get("/problems")
    assert r.status_code == 200
    got = rows(r.text)
    assert [int(x["id"]) for x in got] == expected(url, limit=50)
    assert len(got) == N_A + N_B  # 36 < 50: one page
    assert f"of <strong>{N_A + N_B}</strong>" in r.text
    first = got[0]
    assert set(first) >= {"device", "pattern", "equation", "shapes", "dtype", "mesh", "winner",
                          "speedup [95% CI]", "trials", "updated"}


def test_table_filters(client, seeded, info):
    url, _ = seeded
    only_b = rows(client.get("/problems", params={"device": DEV_B.key}).text)
    assert len(only_b) == N_B and {r["device"] for r in only_b} == {f"{EVIL} ×4 · lab-ring-1gbit"}
    assert {r["pattern"] for r in only_b} == {"reduce_scatter:free_lhs"}

    bf16 = rows(client.get("/problems", params={"dtype": "bfloat16"}).text)
    assert len(bf16) == N_B and {r["dtype"] for r in bf16} == {"bfloat16"}

    base = rows(client.get("/problems", params={"method": "baseline"}).text)
    assert len(base) == sum(1 for i in range(N_A) if i % 5 == 0)
    assert {r["winner"] for r in base} == {"baseline"}

    pattern = rows(client.get("/problems", params={"pattern": "all_gather:lhs:free"}).text)
    assert len(pattern) == N_A

    key = info["a"][7].key
    by_key = rows(client.get("/problems", params={"q": key[:12]}).text)
    assert [int(r["id"]) for r in by_key] == [info["a"][7].id]
    by_eq = rows(client.get("/problems", params={"q": "mk,kn"}).text)
    assert len(by_eq) == N_A + N_B
    assert rows(client.get("/problems", params={"q": "zz,yy"}).text) == []
    assert "No tuned problem matches" in client.get("/problems", params={"q": "zz,yy"}).text

    # filters combine, and an empty value (a form's "any") is no filter
    both = client.get("/problems", params={"device": DEV_A.key, "method": "ring", "dtype": "",
                                           "pattern": "", "q": ""})
    assert [int(r["id"]) for r in rows(both.text)] == expected(
        url, device_key=DEV_A.key, method="ring", limit=50)


def test_table_sort(client, seeded):
    url, _ = seeded
    for sort in ("speedup", "trials", "updated", "pattern", "flops", "comm_bytes"):
        for order in ("asc", "desc"):
            page = client.get("/problems", params={"sort": sort, "order": order, "per_page": 25})
            assert [int(r["id"]) for r in rows(page.text)] == expected(
                url, sort=sort, desc=order == "desc", limit=25), (sort, order)
    speedups = [float(r["speedup [95% CI]"].split("×")[0])
                for r in rows(client.get("/problems?sort=speedup&order=desc").text)]
    assert speedups == sorted(speedups, reverse=True)
    # the column header toggles the order and keeps the filters
    page = client.get("/problems", params={"sort": "speedup", "order": "desc", "dtype": "float32"}).text
    assert 'href="/problems?dtype=float32&amp;sort=speedup&amp;order=asc"' in page


def test_table_pagination(client, seeded):
    url, _ = seeded
    seen: list[int] = []
    for n in range(1, 5):
        page = client.get("/problems", params={"per_page": 10, "page": n, "sort": "speedup"})
        ids = [int(r["id"]) for r in rows(page.text)]
        assert ids == expected(url, sort="speedup", offset=10 * (n - 1), limit=10)
        seen += ids
    assert len(seen) == len(set(seen)) == N_A + N_B
    second = client.get("/problems?per_page=10&page=2&sort=speedup").text
    assert 'rel="prev"' in second and 'rel="next"' in second
    assert 'href="/problems?sort=speedup&amp;page=3&amp;per_page=10" rel="next"' in second
    assert "page 2 of 4" in second
    last = client.get("/problems?per_page=10&page=4").text
    assert 'rel="next"' not in last and len(rows(last)) == N_A + N_B - 30
    past = client.get("/problems?per_page=10&page=99")
    assert past.status_code == 200 and rows(past.text) == [] and "past the end" in past.text


# --------------------------------------------------------------------------- problem page


def test_problem_page(client, info):
    rec = info["a"][3]  # i=3: uni wins, a failed bidi trial
    r = client.get(f"/problems/{rec.id}")
    assert r.status_code == 200
    page = r.text
    strategies = figure(page, f"fig-strategies-{info['device_a'].id}")
    by_name = {t["name"]: t for t in strategies["data"]}
    assert set(by_name) == {"baseline", "winner"}
    assert by_name["winner"]["y"] == [UNI.key] and by_name["baseline"]["y"] == ["baseline"]
    base_ms = 1e-3 * 4 * 1e3
    assert by_name["baseline"]["x"] == [pytest.approx(base_ms)]
    err = by_name["baseline"]["error_x"]  # IQR of the samples: +-2% around the median
    assert err["array"][0] == pytest.approx(0.02 * base_ms) and err["arrayminus"][0] > 0
    assert "not recorded" in strategies["layout"]["title"]["subtitle"]["text"]
    assert "Bound max(T_comm, T_comp) + fill: not recorded" in page

    history = figure(page, f"fig-history-{info['device_a'].id}")
    trial = next(t for t in history["data"] if t["name"] == "trial")
    assert trial["x"] == [1, 2] and trial["y"][0] == 1.0
    assert next(t for t in history["data"] if t["name"] == "failed")["x"] == [3]

    # the failure's reason, escaped; the Problem JSON to copy
    assert "RESOURCE_EXHAUSTED: &lt;/pre&gt;&lt;b&gt;out of memory&lt;/b&gt;" in page
    pre = re.search(r'<pre id="problem-json">(.*?)</pre>', page, re.S)
    assert pre and json.loads(html.unescape(pre.group(1))) == rec.canonical
    assert Problem.from_dict(json.loads(html.unescape(pre.group(1)))).key == rec.key
    assert 'class="copy" data-copy="problem-json"' in page


def test_a_winners_split_by_its_serial_control_is_shown(client, info):
    """Device B's winners were timed beside their serial control: the table and the problem page
    say how much of the speedup is traffic and how much overlap; device A's (no control) say nothing."""
    split = "traffic 1.100× · overlap 1.182×"
    table = rows(client.get("/problems?limit=100").text)
    by_id = {int(r["id"]): r["speedup [95% CI]"] for r in table}
    assert all(by_id[rec.id].endswith(split) for rec in info["b"])
    assert not any("traffic" in by_id[rec.id] for rec in info["a"])
    assert split in client.get(f"/problems/{info['b'][0].id}").text
    assert "traffic" not in client.get(f"/problems/{info['a'][3].id}").text


def test_problem_page_by_key_and_bidi(client, info):
    rec = info["a"][13]  # i=13: uni and bidi measured, bidi faster
    page = client.get(f"/problems/{rec.key}").text
    strategies = figure(page, f"fig-strategies-{info['device_a'].id}")
    names = {t["name"]: t["y"] for t in strategies["data"]}
    assert names["winner"] == [BIDI.key] and names["other strategies"] == [UNI.key]


def test_problem_not_found(client):
    for ref in ("999999", "99999999999999999999", "no-such-key", "bad%20key", "%00", "x" * 200):
        r = client.get(f"/problems/{ref}")
        assert r.status_code == 404, ref
        assert "No such problem" in r.text and r.headers["content-type"].startswith("text/html")


# --------------------------------------------------------------------------- escaping


def test_everything_is_escaped(client, info):
    raw = EVIL
    pages = [client.get("/").text, client.get("/problems").text,
             client.get(f"/problems/{info['b'][0].id}").text]
    for page in pages:
        assert raw not in page
        assert "<script>alert" not in page
    escaped = "&lt;script&gt;alert(&#34;kind&#34;)&lt;/script&gt;"
    assert all(escaped in page for page in pages)  # the device's kind, shown as text
    reflected = client.get("/problems", params={"q": '"><script>x()</script>'}).text
    assert "<script>x()" not in reflected and "&#34;&gt;&lt;script&gt;x()" in reflected


def test_figure_json_cannot_close_its_script_tag():
    import plotly.graph_objects as go

    from service.dashboard.figures import embed

    fig = go.Figure(go.Scatter(x=[1], y=[1], text=["</script><script>alert(1)</script>&"]))
    text = str(embed(fig))
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text)["data"][0]["text"] == ["</script><script>alert(1)</script>&"]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("query", [
    "sort=bogus", "order=sideways", "page=0", "page=-1", "page=abc", "page=1e3",
    "page=99999999999999999999", "per_page=0", "per_page=100000", "per_page=x",
    "q=a%00b", f"q={'x' * 300}", f"device={'d' * 200}", "dtype=%00",
])
def test_bad_table_params_give_400(client, query):
    r = client.get(f"/problems?{query}")
    assert r.status_code == 400, (query, r.status_code)
    assert r.headers["content-type"].startswith("text/html") and "Bad request" in r.text


def test_bad_overview_params_give_400(client):
    assert client.get(f"/?device={'d' * 200}").status_code == 400
    assert client.get("/?device=%00").status_code == 400
    assert client.get("/?unknown=1").status_code == 200


def test_odd_but_valid_params(client):
    for query in ("q=%25", "q=_", "q=%5C", "q='%20OR%201=1--", "device=%F0%9F%98%80",
                  "pattern=none", "sort=&order=&page=&per_page=", "page=1&page=2",
                  "q=%ED%A0%80"):  # invalid UTF-8: decoded with replacement characters
        r = client.get(f"/problems?{query}")
        assert r.status_code == 200, query


# --------------------------------------------------------------------------- static files


def test_plotly_is_served_locally(client):
    r = client.get("/static/plotly.min.js?v=1")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/javascript")
    assert r.headers["content-encoding"] == "gzip"  # httpx asks for gzip and decodes it
    assert "max-age" in r.headers["cache-control"] and r.headers["etag"]
    plotly_js = Assets().get("plotly.min.js")
    assert plotly_js is not None and r.content == plotly_js.body
    assert b"plotly.js v" in r.content[:200]
    again = client.get("/static/plotly.min.js", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    plain = client.get("/static/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and len(plain.content) == len(plotly_js.body)
    assert gzip.decompress(plotly_js.gzipped) == plotly_js.body


def test_own_static_files_and_unknown_names(client):
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/static/dashboard.css").headers["content-type"].startswith("text/css")
    for name in ("nope.js", "..%2Fapp.py", "%2e%2e%2f%2e%2e%2fetc%2fpasswd"):
        assert client.get(f"/static/{name}").status_code == 404


# --------------------------------------------------------------------------- auth


def test_read_tokens_protect_the_pages(seeded, tmp_path):
    url, _ = seeded
    path = tmp_path / "copy.db"
    shutil.copyfile(url.removeprefix("sqlite:///"), path)
    app = with_dashboard(create_app(Settings(db_url=f"sqlite:///{path}",
                                             write_tokens=[WRITE_TOKEN], read_tokens=[READ_TOKEN])))
    with TestClient(app) as c:
        for page in ("/", "/problems", "/problems/1"):
            assert c.get(page).status_code == 401
            assert c.get(page, headers=READ_HEADERS).status_code == 200
        assert c.get("/static/dashboard.css").status_code == 200


def test_views_format():
    assert views.fmt_shapes({"lhs": {"shape": [8, 2048], "spec": [None, ["data", "x"]]},
                             "rhs": {"shape": [2048, 16], "spec": ["x"]}}) == \
        "8×2048/(data,x) · 2048/x×16"
    assert views.fmt_mesh({"mesh": {"data": 2, "x": 4}}) == "data=2, x=4"
    assert views.fmt_time(0.00125) == "1.25 ms" and views.fmt_time(None) == "—"
    assert views.fmt_ci(1.2, 1.3) == "[1.200, 1.300]" and views.fmt_ci(None, 1.0) == ""
    assert views.fmt_bytes(3 * 2**20) == "3 MiB"
    assert Path(views.__file__).parent.joinpath("templates", "base.html").exists()


def test_pages_on_every_backend(db_url):
    """Every page and the table's sorts on this backend (PostgreSQL too, where marked)."""
    database = Database(db_url)
    try:
        info = seed(database)
    finally:
        database.dispose()
    app = with_dashboard(create_app(Settings(db_url=db_url, write_tokens=[WRITE_TOKEN])))
    with TestClient(app) as c:
        page = c.get("/").text
        assert sum(sum(t["y"]) for t in figure(page, "fig-speedups")["data"]) == N_A + N_B
        for sort in ("speedup", "updated", "pattern", "trials"):
            r = c.get("/problems", params={"sort": sort, "order": "asc", "per_page": 25,
                                           "page": 2, "q": "mk", "dtype": "float32"})
            assert r.status_code == 200 and len(rows(r.text)) == N_A - 25
        assert len(rows(c.get("/problems", params={"method": "baseline"}).text)) == 6
        assert c.get(f"/problems/{info['a'][3].id}").status_code == 200
        assert c.get("/problems?page=abc").status_code == 400


def test_empty_database(sqlite_url):
    database = Database(sqlite_url)
    try:
        with database.session() as s:  # a problem that was never measured
            p = Problem.from_dict(problem(m=64, k=64, n=64))
            rec = repo.upsert_problem(s, **problem_values(p))
    finally:
        database.dispose()
    app = with_dashboard(create_app(Settings(db_url=sqlite_url)))
    with TestClient(app) as c:
        page = c.get("/").text
        for text in ("Nothing tuned yet", "No winners yet", "No lookups since",
                     "No open demand", "No job is queued or running"):
            assert text in page
        assert 'id="fig-' not in page
        assert "No tuned problem matches" in c.get("/problems").text
        assert "No measurement of this problem is stored" in c.get(f"/problems/{rec.id}").text
