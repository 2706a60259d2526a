"""report.html and compare.html, checked in a real browser: headless Chromium driven by selenium."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from headscope.report.page import report_page, write_page
from headscope.report.report import Report

from browser import CHROMIUM, DRIVER, chromium, console_problems, needs_browser
from helpers import run_cli
from synthetic import synthetic_report

# Anything that could make the browser fetch something: a URL, a scheme-relative source, an import.
RESOURCE = re.compile(r"https?://|(?:src|href)\s*=\s*[\"']?//|url\(\s*[\"']?//|@import", re.IGNORECASE)


@pytest.fixture(scope="module")
def report(planted_gpt2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report"
    assert run_cli("analyze", planted_gpt2, "--out", out, "--no-charts").exit_code == 0
    return out


def test_the_page_references_nothing_online(report):
    html = (report / "report.html").read_text(encoding="utf-8")
    assert "plotly" in html.lower() and "<script src" not in html
    assert not RESOURCE.findall(html)


def test_data_cannot_break_out_of_its_script():
    heads = pd.read_parquet(Path(__file__).resolve().parents[2] / "examples/reports/smollm2/heads.parquet")
    heads.loc[0, "type_reason"] = "</script><script>alert(1)</script>"
    heads.loc[1, "type_reason"] = "see https://example.org"
    run = {"model": {"input": "<b>x</b>"}, "corpus": {"path": "c.txt", "sentences": 1}}
    html = report_page(Report(run, tables={"heads.parquet": heads}))
    assert html.count("<script") == html.count("</script>") == 3  # the page's own three: plotly, data, app
    assert "alert(1)" in html and not RESOURCE.findall(html)
    assert "<title>headscope: &lt;b&gt;x&lt;/b&gt; on c.txt (1 sentences)</title>" in html


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("no chromium")
    driver = chromium()
    yield driver
    driver.quit()


def open_page(browser, path: Path, timeout: float = 30.0) -> float:
    """Open `path`, wait until its script says it is ready; return the seconds that took."""
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get_log("performance")
    started = time.perf_counter()
    browser.get(path.resolve().as_uri())
    while browser.execute_script("return document.body && document.body.dataset.ready") != "true":
        assert time.perf_counter() - started < timeout, "the page never became ready"
        time.sleep(0.05)
    return time.perf_counter() - started


def requested(browser) -> list[str]:
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def cell_offset(browser, layer: int, head: int) -> tuple[int, int]:
    """Where the heatmap draws (layer, head), as an offset from the plot's centre (selenium's origin)."""
    return tuple(
        int(v)
        for v in browser.execute_script(
            """const gd = document.getElementById('heatmap'), L = gd._fullLayout, r = gd.getBoundingClientRect();
        return [L.xaxis._offset + L.xaxis.l2p(arguments[1]) - r.width / 2,
                L.yaxis._offset + L.yaxis.l2p(arguments[0]) - r.height / 2];""",
            layer,
            head,
        )
    )


@needs_browser
def test_the_report_page_in_a_real_browser(browser, report, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    heads = pd.read_parquet(report / "heads.parquet").set_index(["layer", "head"])
    open_page(browser, report / "report.html")
    n_layers, n_heads = heads.index.levels[0].size, heads.index.levels[1].size
    z = browser.execute_script("return document.getElementById('heatmap').data[0].z")
    assert len(z) == n_layers and all(len(row) == n_heads for row in z)  # one cell per head
    assert z[0][1] == pytest.approx(heads.loc[(0, 1), "entropy"], rel=1e-5)

    plot = browser.find_element(By.ID, "heatmap")
    ActionChains(browser).move_to_element_with_offset(plot, *cell_offset(browser, 0, 1)).perform()
    time.sleep(0.3)
    assert browser.find_element(By.ID, "panel-title").text == "layer 0, head 1"
    panel = dict(line.split(" ", 1) for line in browser.find_element(By.ID, "panel-table").text.splitlines())
    expected = heads.loc[(0, 1)]
    assert panel["role"] == expected["role"] and panel["head_type"] == expected["head_type"]
    assert float(panel["entropy"]) == pytest.approx(expected["entropy"], abs=1e-4)
    assert float(panel["probe_previous"]) == pytest.approx(expected["probe_previous"], abs=1e-4)
    # What a researcher reads first: the role, why, what a sink does off the sink, how much the head writes; about
    # twenty rows of evidence, and every other column (some seventy) behind "every column", closed.
    keys = [line.split(" ", 1)[0] for line in browser.find_element(By.ID, "panel-table").text.splitlines()]
    assert keys[:4] == ["role", "role_reason", "role_detail", "write_ratio"] and len(keys) <= 25
    assert float(panel["write_ratio"]) == pytest.approx(expected["write_ratio"], abs=1e-4)
    more = browser.find_element(By.CSS_SELECTOR, "#panel details")
    assert more.get_attribute("open") is None
    more.find_element(By.TAG_NAME, "summary").click()
    rest = dict(line.split(" ", 1) for line in more.find_element(By.TAG_NAME, "table").text.splitlines())
    assert float(rest["entropy_ci_low"]) == pytest.approx(expected["entropy_ci_low"], abs=1e-4)

    ActionChains(browser).move_to_element_with_offset(plot, *cell_offset(browser, 0, 2)).click().perform()
    time.sleep(0.5)
    example = browser.execute_script(
        "const g = document.getElementById('example'); return [g.layout.title.text, g.data[0].x, g.data[0].z];"
    )
    assert example[0].startswith("layer 0, head 2 (sink): attention on corpus sentence")  # where a sink shows
    views = pd.read_parquet(report / "examples.parquet")
    first = views[(views["source"] == "corpus") & (views["sentence_id"] == int(example[0].rsplit(" ", 1)[1]))]
    tokens = first.drop_duplicates("query").sort_values("query")["query_token"].tolist()
    assert [label.split(": ", 1)[1] for label in example[1]] == tokens
    assert all(row[0] > 0.95 for row in example[2][1:])  # the first-token head: nearly all on token 0

    # The previous-token head opens on the probe sequence, its role's view, with the diagonal stripe.
    ActionChains(browser).move_to_element_with_offset(plot, *cell_offset(browser, 0, 1)).click().perform()
    time.sleep(0.5)
    title, z = browser.execute_script(
        "const g = document.getElementById('example'); return [g.layout.title.text, g.data[0].z];"
    )
    assert title == "layer 0, head 1 (previous-token): attention on probe: repeated random tokens"
    assert all(z[p][p - 1] > 0.95 for p in range(1, len(z)))
    buttons = browser.find_elements(By.CSS_SELECTOR, "#views button")
    assert [b.get_attribute("data-view") for b in buttons][-1] == "probe" and len(buttons) >= 2
    buttons[0].click()  # the other views are a click away
    time.sleep(0.3)
    assert "corpus sentence" in browser.execute_script("return document.getElementById('example').layout.title.text")

    # The scales drawn are the palette's, the direction of the PNG charts: entropy light when focused, shares
    # bright when high; roles in their own colours.
    from headscope.report import palette

    scale = browser.execute_script("return document.getElementById('heatmap').data[0].colorscale")
    assert [colour for _, colour in scale] == palette.SCALES["entropy"][1]
    browser.find_element(By.CSS_SELECTOR, "#metric option[value='sink']").click()
    drawn = browser.execute_script(
        "const d = document.getElementById('heatmap').data[0]; return [d.z, d.colorscale, d.zmin, d.zmax];"
    )
    assert drawn[0][0][2] == pytest.approx(heads.loc[(0, 2), "sink"], rel=1e-5)
    assert [colour for _, colour in drawn[1]] == palette.SCALES["share"][1] and drawn[2:] == [0, 1]
    browser.find_element(By.CSS_SELECTOR, "#metric option[value='role']").click()
    roles = browser.execute_script(
        "const d = document.getElementById('heatmap').data[0]; return [d.text, d.colorscale];"
    )
    assert roles[0][0][1] == heads.loc[(0, 1), "role"]
    assert set(colour for _, colour in roles[1]) == set(palette.ROLES.values())

    # The table leads with role, its reason, what a sink does off the sink and the probes; a click on a row
    # selects that head everywhere.
    headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#heads-table th")]
    assert headers[:8] == [
        "layer",
        "head",
        "role",
        "role_reason",
        "role_detail",
        "probe_induction",
        "probe_duplicate",
        "probe_previous",
    ]
    browser.find_element(By.XPATH, "//table[@id='heads-table']//th[text()='entropy']").click()
    cells = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "#heads-table tbody tr:first-child td")]
    assert float(cells[headers.index("entropy")]) == pytest.approx(heads["entropy"].min(), abs=1e-4)
    browser.find_element(By.ID, "filter").send_keys("layer 1")
    assert browser.find_element(By.ID, "table-count").text.startswith(f"{n_heads} of {len(heads)} heads")
    browser.find_element(By.CSS_SELECTOR, "#heads-table tbody tr:first-child").click()
    time.sleep(0.3)
    assert browser.find_element(By.ID, "panel-title").text.startswith("layer 1, head")
    assert browser.execute_script("return document.getElementById('heatmap').layout.shapes.length") == 1

    shot = tmp_path / "report-page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000
    assert console_problems(browser) == []
    assert all(url.startswith(("file:", "data:", "blob:")) for url in requested(browser)), requested(browser)


@needs_browser
def test_a_heads_exemplars_are_one_click_from_its_row(browser, report, tmp_path):
    """A click on a head's row in the table shows its corpus exemplars as token strips: the kind its role names
    first, the query outlined and the key shaded, each as exemplars.parquet records it."""
    from selenium.webdriver.common.by import By

    table = pd.read_parquet(report / "exemplars.parquet")
    open_page(browser, report / "report.html")
    browser.find_element(By.ID, "filter").send_keys("layer 0, head 1")  # the planted previous-token head
    browser.find_element(By.CSS_SELECTOR, "#heads-table tbody tr:first-child").click()
    time.sleep(0.3)
    assert browser.find_element(By.ID, "exemplars-title").text == "Where layer 0, head 1 does it in the corpus"
    kinds = browser.find_elements(By.CSS_SELECTOR, "#exemplar-kinds button")
    assert [b.get_attribute("data-kind") for b in kinds] == list(dict.fromkeys(table["kind"]))
    assert [b.get_attribute("data-kind") for b in kinds if not b.is_enabled()] == ["previous"]  # its role's kind

    def shown() -> list[tuple]:
        strips = []
        for strip in browser.find_elements(By.CSS_SELECTOR, "#exemplars .exemplar"):
            query = strip.find_element(By.CSS_SELECTOR, "span.query")
            key = strip.find_element(By.CSS_SELECTOR, "span.key")
            strips.append((strip.find_element(By.CSS_SELECTOR, ".muted").text,
                           int(query.get_attribute("data-position")), query.text,
                           int(key.get_attribute("data-position")), key.text))  # fmt: skip
        return strips

    for kind in ("previous", "sharp"):
        browser.find_element(By.CSS_SELECTOR, f"#exemplar-kinds button[data-kind='{kind}']").click()
        expected = table[(table["layer"] == 0) & (table["head"] == 1) & (table["kind"] == kind)].sort_values("rank")
        strips = shown()
        assert len(strips) == len(expected) == 10
        for (caption, row, query, key, key_text), e in zip(strips, expected.itertuples(), strict=True):
            assert caption.startswith(f"{e.rank}. sentence {e.sentence}, row {e.row} \u2192 key {e.key} (weight ")
            assert (row, key) == (e.row, e.key) == (e.row, e.row - 1)  # the planted head: the previous token
            assert (query, key_text) == (e.query_token.strip(), e.key_token.strip())
    browser.save_screenshot(str(tmp_path / "exemplars.png"))
    assert console_problems(browser) == []


@needs_browser
def test_inspect_exemplars_opens_each_sentence_at_its_exemplar(browser, report, tmp_path):
    """inspect --exemplars: the page opens each sentence at its strongest exemplar's row, one button per exemplar."""
    from selenium.webdriver.common.by import By

    out = tmp_path / "seen"
    assert run_cli("inspect", "--exemplars", "0.1", report, "--out", out).exit_code == 0
    texts = json.loads((out / "inspect.json").read_text())["texts"]
    open_page(browser, out / "inspect.html")
    for number in (0, len(texts) - 1):
        browser.find_element(By.CSS_SELECTOR, f"#text option[value='{number}']").click()
        time.sleep(0.3)
        marks = texts[number]["exemplars"]
        buttons = browser.find_elements(By.CSS_SELECTOR, "#marks button")
        assert [int(b.get_attribute("data-row")) for b in buttons] == [m["row"] for m in marks]
        assert browser.find_element(By.ID, "query-title").text.startswith(f"query {marks[0]['row']} ")
        buttons[-1].click()
        assert browser.find_element(By.ID, "query-title").text.startswith(f"query {marks[-1]['row']} ")
        shaded = browser.find_element(By.CSS_SELECTOR, f"#tokens span[data-position='{marks[-1]['key']}']")
        shown = float(shaded.get_attribute("title").rsplit("weight ", 1)[1])  # 4 decimals
        assert shown == pytest.approx(marks[-1]["weight"], abs=6e-5)
    browser.save_screenshot(str(tmp_path / "inspect-exemplars.png"))
    assert console_problems(browser) == []


@needs_browser
def test_the_compare_page_in_a_real_browser(browser, report, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    out = tmp_path / "comparison"
    assert run_cli("compare", report, report, "--out", out, "--no-charts", "--replicates", "50").exit_code == 0
    html = (out / "compare.html").read_text(encoding="utf-8")
    assert not RESOURCE.findall(html)
    open_page(browser, out / "compare.html")
    plot = browser.find_element(By.ID, "heatmap")
    ActionChains(browser).move_to_element_with_offset(plot, *cell_offset(browser, 1, 0)).perform()
    time.sleep(0.3)
    assert browser.find_element(By.ID, "panel-title").text == "layer 1, head 0"
    panel = dict(line.split(" ", 1) for line in browser.find_element(By.ID, "panel-table").text.splitlines())
    assert float(panel["entropy_delta"]) == 0.0 and panel["entropy_significant"] == "no"

    # A delta is drawn on the diverging scale, as the PNG chart draws it.
    from headscope.report import palette

    scale = browser.execute_script("return document.getElementById('heatmap').data[0].colorscale")
    assert [colour for _, colour in scale] == palette.SCALES["diverging"][1]
    # The reports are named by model and corpus (and folder, when those agree), not "A" and "B".
    record = json.loads((out / "compare.json").read_text())
    sides = browser.find_element(By.ID, "sides").text
    assert record["a"]["name"] in sides and record["a"]["name"].endswith("(report)")
    # The head table: every head, none with a significant change in a report compared with itself.
    n_heads = len(pd.read_parquet(report / "heads.parquet"))
    assert browser.find_element(By.ID, "table-count").text == f"{n_heads} of {n_heads} heads"
    headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#compare-table th")]
    assert headers[:4] == ["layer", "head", "role_a", "role_b"] and "entropy_p" in headers
    assert not [h for h in headers if h.endswith(("_ci_low_delta", "_chance_delta"))]
    browser.find_element(By.ID, "significant-only").click()
    assert browser.find_element(By.ID, "table-count").text == f"0 of {n_heads} heads"
    assert console_problems(browser) == []


@needs_browser
def test_a_70b_sized_page_stays_small_and_usable(browser, tmp_path):
    """80 layers x 64 heads (Llama-70B's grid) with a 32-token example and 10 exemplars per head and kind: under
    16 MB (13.2 of them the grid and the example), every cell there and live, and the exemplars it has room for."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    folder = tmp_path / "big"
    synthetic_report(folder, 80, 64, example_tokens=32, exemplars=10)
    page = write_page(report_page(Report.open(folder), files_in=folder), folder / "report.html")
    assert page.stat().st_size < 16e6
    seconds = open_page(browser, page, timeout=60)
    print(f"80 x 64 page: {page.stat().st_size / 1e6:.1f} MB, interactive after {seconds:.1f} s")
    z = browser.execute_script("return document.getElementById('heatmap').data[0].z")
    assert len(z) == 80 and all(len(row) == 64 for row in z)
    browser.set_window_size(1400, 3000)  # the whole 80-row heatmap in view, so its last cell can be clicked
    time.sleep(0.5)  # plotly redraws a responsive plot after the resize
    plot = browser.find_element(By.ID, "heatmap")
    ActionChains(browser).move_to_element_with_offset(plot, *cell_offset(browser, 79, 63)).click().perform()
    time.sleep(0.5)
    assert browser.find_element(By.ID, "panel-title").text == "layer 79, head 63"
    title = browser.execute_script("return document.getElementById('example').layout.title.text")
    assert title.startswith("layer 79, head 63 (") and title.endswith("attention on corpus sentence 0")
    about = browser.find_element(By.ID, "exemplars-about").text
    assert about.endswith("(the page shows the top 1 of the 10 in exemplars.parquet).")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#exemplars .exemplar")) == 1
    browser.save_screenshot(str(tmp_path / "big-page.png"))
    browser.set_window_size(1400, 1400)
    assert console_problems(browser) == []


@needs_browser
def test_a_report_without_values_still_becomes_interactive(browser, tmp_path):
    """float16 overflow can leave every head NaN: the page shows "no value" and its script does not throw."""
    import numpy as np

    from headscope.tables import HEADS_SCHEMA, write_table

    folder = tmp_path / "nan"
    synthetic_report(folder, 4, 3, example_tokens=6)
    heads = pd.read_parquet(folder / "heads.parquet")
    for column in heads.columns:
        if heads[column].dtype.kind == "f":
            heads[column] = np.nan
    heads["top_offset"] = None
    write_table(heads, folder / "heads.parquet", HEADS_SCHEMA)
    page = write_page(report_page(Report.open(folder), files_in=folder), folder / "report.html")
    open_page(browser, page)
    from selenium.webdriver.common.by import By

    assert "No metric has a value" in browser.find_element(By.ID, "heatmap").text
    assert console_problems(browser) == []


@needs_browser
@pytest.mark.slow
def test_the_inspect_page_in_a_real_browser(browser, smollm2, tmp_path):
    """inspect.html: an induction head opens on the probe text; hovering a token draws its row's weights (those
    of attention.parquet); tokens that look like HTML are shown as text, never rendered or followed."""
    from selenium.webdriver.common.by import By

    import headscope

    hostile = '<b>bold</b> <img src=x onerror="document.title=1"> <a href="https://example.com">x</a> & done'
    out = tmp_path / "seen"
    seen = headscope.inspect(smollm2, texts=[hostile], probes=["induction"], roles=["induction"], out=out)
    assert "18.6" in seen.record["heads"]
    open_page(browser, out / "inspect.html")
    assert console_problems(browser) == []
    assert all(url.startswith(("file:", "data:", "blob:")) for url in requested(browser)), requested(browser)

    browser.find_element(By.CSS_SELECTOR, "#head option[value='18.6']").click()
    time.sleep(0.3)
    title = browser.execute_script("return document.getElementById('attention').layout.title.text")
    assert title == "head 18.6 on probe seed 0"  # an induction head opens where its role shows
    attention = pd.read_parquet(out / "attention.parquet")
    probe = attention[(attention["text_id"] == 1) & (attention["layer"] == 18) & (attention["head"] == 6)]
    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens span")
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('mouseenter'))", spans[40])
    drawn = browser.execute_script("const d = document.getElementById('row').data[0]; return [d.x, d.y];")
    row = probe[probe["query"] == 40].sort_values("key")
    assert drawn[0] == row["key"].tolist()
    np.testing.assert_allclose(drawn[1], row["weight"], atol=1 / 65535)
    assert "query 40" in browser.find_element(By.ID, "query-title").text

    browser.find_element(By.CSS_SELECTOR, "#text option[value='0']").click()
    time.sleep(0.3)
    tokens = pd.read_parquet(out / "tokens.parquet").query("text_id == 0")["token"].tolist()
    shown = [span.get_attribute("textContent") for span in browser.find_elements(By.CSS_SELECTOR, "#tokens span")]
    assert shown == tokens  # each token as it is, spaces kept
    assert browser.find_element(By.ID, "tokens").text.replace(" ", "").startswith("<b>bold</b>")
    assert browser.execute_script("return document.querySelectorAll('#tokens *:not(span), #attention a').length") == 0
    assert browser.title != "1"  # the <img onerror> never ran
    assert console_problems(browser) == []
    browser.save_screenshot(str(tmp_path / "inspect-page.png"))


@needs_browser
@pytest.mark.slow
def test_the_why_matrix_shows_the_hovered_rows_senders(browser, tmp_path):
    """inspect --why on the planted induction circuit: hovering an explained row (underlined in the strip) draws its
    matrix of contrasts, the pair (embed -> query, 0.0 -> key) strongest, each side's sums on the margins; a row
    --why did not explain says so."""
    from selenium.webdriver.common.by import By

    from planted import build_planted_induction

    folder = build_planted_induction(tmp_path / "induction")
    out = tmp_path / "why"
    text = "w3 w5 w9 w12 w20 w5 w9"
    assert run_cli("inspect", str(folder), "--text", text, "--heads", "1.0", "--why", "5-6", "--out", out,
                   "--device", "cpu").exit_code == 0  # fmt: skip
    rows = {entry["row"]: entry for entry in json.loads((out / "inspect.json").read_text())["why"]["rows"]}
    open_page(browser, out / "inspect.html")
    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens span")
    assert [int(s.get_attribute("data-position")) for s in spans if "explained" in s.get_attribute("class")] == [5, 6]
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('mouseenter'))", spans[5])
    drawn = browser.execute_script(
        "const d = document.getElementById('why').data; return [d[0].x, d[0].y, d[0].z, d[1].y, d[2].x];"
    )
    keys, queries, contrast, key_side, query_side = drawn
    assert (queries[0], keys[0]) == ("embed", "0.0")
    assert contrast[0][0] == pytest.approx(rows[5]["pairs"][0][2], rel=1e-4)
    assert sum(key_side) == pytest.approx(rows[5]["contrast"], rel=1e-4)
    assert sum(query_side) == pytest.approx(rows[5]["contrast"], rel=1e-4)
    assert "why row 5" in browser.find_element(By.ID, "why-title").text and "key 2" in browser.find_element(
        By.ID, "why-title").text  # fmt: skip
    browser.execute_script("document.getElementById('why-box').scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "inspect-why.png"))
    spans = browser.find_elements(By.CSS_SELECTOR, "#tokens span")  # the strip is drawn again for each row
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('mouseenter'))", spans[3])
    assert "not explained" in browser.find_element(By.ID, "why-title").text
    assert console_problems(browser) == []


@needs_browser
@pytest.mark.slow
def test_the_circuit_page_in_a_real_browser(browser, tmp_path):
    """circuit.html on the planted induction circuit: the graph draws the smallest faithful circuit's edges and
    their nodes, the curve its points, the table the strongest edges; a row clicked picks its edge out (the others
    fade) and widens the graph to reach it; nothing is fetched and nothing is logged."""
    from selenium.webdriver.common.by import By

    from planted import build_planted_induction

    model = build_planted_induction(tmp_path / "model", predicts=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"clean": "w5 w9 w12 w20 w5", "corrupt": "w7 w9 w12 w20 w5", "answer": "w9",
                                 "distractor": "w12"}) + "\n")  # fmt: skip
    out = tmp_path / "circuit"
    assert run_cli("circuit", model, "--pairs", pairs, "--out", out, "--no-charts", "--steps", "2").exit_code == 0
    html = (out / "circuit.html").read_text(encoding="utf-8")
    assert not RESOURCE.findall(html)
    open_page(browser, out / "circuit.html")
    record = json.loads((out / "circuit.json").read_text())
    shown = record["circuit"]["edges"]
    traces = browser.execute_script("return document.getElementById('graph').data")
    assert len(traces) == shown + 1  # an edge a line, and the nodes
    assert (
        browser.execute_script("return document.getElementById('curve').data[0].x.length")
        == len(record["faithfulness"]) - 1
    )  # every point but the empty circuit's (a log axis)
    rows = browser.find_elements(By.CSS_SELECTOR, "#edge-table tr")
    assert len(rows) == 1 + min(100, record["graph"]["edges"])
    rows[shown + 2].click()  # an edge beyond the circuit
    assert int(browser.find_element(By.ID, "count").get_attribute("value")) == shown + 2
    faded = browser.execute_script("return document.getElementById('graph').data.slice(0, -1).map(t => t.line.color)")
    assert sum(colour.endswith(",0.7)") for colour in faded) == 1 and len(faded) == shown + 2
    assert all(url.startswith(("file:", "data:", "blob:")) for url in requested(browser)), requested(browser)
    assert console_problems(browser) == []


def test_the_page_scales_are_the_charts_colormaps():
    """The stops the page draws are matplotlib's own colormaps (the PNG charts'), sampled evenly, low to high."""
    import matplotlib
    from matplotlib.colors import to_hex

    from headscope.report import palette

    for name, (colormap, colours, _, _) in palette.SCALES.items():
        sampled = matplotlib.colormaps[colormap]
        expected = [to_hex(sampled(i / (len(colours) - 1))) for i in range(len(colours))]
        assert colours == expected, name


def test_every_page_draws_with_the_palettes_stops_never_a_named_scale():
    """The report's example heatmap once used Plotly's own "Blues" where the inspection page used the palette: the
    pages and the PNGs share one palette (palette.py), so no asset names a scale of its own, and no chart names a
    colormap the palette does not hold."""
    import re
    from pathlib import Path

    from headscope.report import palette

    root = Path(palette.__file__).parent
    for script in sorted((root / "assets").glob("*.js")):
        named = re.findall(r"colorscale:\s*[\"'][A-Za-z]+", script.read_text())
        assert not named, f"{script.name} names a Plotly colour scale: {named}"
        assert "reversescale" not in script.read_text(), script.name
    colormaps = {colormap for colormap, _, _, _ in palette.SCALES.values()}
    for module in ("charts.py", "compare_charts.py", "prune_chart.py"):
        for name in re.findall(r"cmap=[\"']([A-Za-z_]+)", (root / module).read_text()):
            assert name in colormaps, f"{module} draws with {name}, which the palette does not hold"


@needs_browser
@pytest.mark.slow  # two searches through the CLI
@pytest.mark.parametrize("mode", ["window", "zero"])
def test_the_prune_page_in_a_real_browser(mode, browser, planted_gpt2, corpus_lines, tmp_path):
    """prune.html: the grid colours exactly the heads prune.json took (in window mode, split by kv-policy.json's
    freed KV heads), the curve draws every accepted step, the table lists the taken heads in removal order, the KV
    cache section shows only for a policy; nothing is fetched and nothing is logged."""
    from selenium.webdriver.common.by import By

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:16]) + "\n")
    out = tmp_path / "pruned"
    window = ["--window", "2", "--sink", "1"] if mode == "window" else []
    result = run_cli("prune", planted_gpt2, "--corpus", corpus, "--budget", "0.5", "--mode", mode, *window,
                     "--max-rounds", "1", "--no-charts", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((out / "prune.json").read_text())
    assert record["heads"], "a budget of 0.5 nats takes some head of the planted model"
    html = (out / "prune.html").read_text(encoding="utf-8")
    assert not RESOURCE.findall(html)
    open_page(browser, out / "prune.html")
    trace = browser.execute_script("return document.getElementById('heatmap').data[0]")
    states = trace["colorbar"]["ticktext"]
    drawn = {(layer, head): states[int(z)] for layer, row in zip(trace["y"], trace["z"], strict=True)
             for head, z in zip(trace["x"], row, strict=True)}  # fmt: skip
    taken = {tuple(map(int, name.split("."))) for name in record["heads"]}
    assert {cell for cell, state in drawn.items() if state not in ("full", "kept")} == taken
    if mode == "window":  # the planted model has a KV head per query head: each windowed head frees its own
        policy = json.loads((out / "kv-policy.json").read_text())
        freed = {(layer["layer"], k) for layer in policy["layers"] for k, kv in enumerate(layer["kv_heads"])
                 if kv == "windowed"}  # fmt: skip
        assert {cell for cell, state in drawn.items() if state == "windowed, its KV head freed"} == freed == taken
        assert "KV heads freed" in browser.find_element(By.ID, "cache").text
    else:
        assert not browser.find_element(By.ID, "cache-box").is_displayed()
    curve = browser.execute_script("return document.getElementById('curve').data[0]")
    assert curve["x"] == [step["heads_removed"] for step in record["curve"]]
    assert curve["y"] == pytest.approx([step["loss"] for step in record["curve"]])
    rows = browser.find_elements(By.CSS_SELECTOR, "#heads-table tbody tr")
    listed = [f"{row.find_elements(By.TAG_NAME, 'td')[1].text}.{row.find_elements(By.TAG_NAME, 'td')[2].text}"
              for row in rows]  # fmt: skip
    assert listed == record["heads"]  # in removal order
    browser.save_screenshot(str(tmp_path / f"prune-{mode}.png"))
    assert all(url.startswith(("file:", "data:", "blob:")) for url in requested(browser)), requested(browser)
    assert console_problems(browser) == []
