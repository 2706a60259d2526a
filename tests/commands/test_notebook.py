"""Results in a notebook: every result object's `_repr_html_` (escaped, NaN as no value, each page isolated in its
own iframe, plotly.js sent once per notebook), and several of them in one page, in headless Chromium."""

from __future__ import annotations

import re
import time

import numpy as np
import pandas as pd
import pytest
import torch

import headscope
from headscope.report.notebook import cell, send_plotly_again, table
from headscope.report.report import Report

from browser import chromium, console_problems, needs_browser

OUTSIDE_IFRAMES = re.compile(r'srcdoc="[^"]*"')  # the pages, escaped: what is left is the cell's own HTML
HELD_PLOTLY = re.compile(r'<script type="text/plain" id="headscope-plotly">.*?</script>', re.S)  # inert: never run
PLOTLY_MB = 4.0  # plotly.js is 4.6 MB: a view holding it is at least this much larger than one without


def own_html(html: str) -> str:
    """The HTML a notebook puts in its own document and runs (every page's text lies escaped in an iframe's srcdoc;
    the plotly.js held for them is text/plain, which a browser never runs)."""
    return HELD_PLOTLY.sub("", OUTSIDE_IFRAMES.sub('srcdoc=""', html))


@pytest.fixture(autouse=True)
def a_fresh_notebook():
    """Each test starts as a new kernel does: the next result shown carries plotly.js."""
    send_plotly_again()


@pytest.fixture(scope="module")
def copier(planted_copier):
    from planted import copied_sentences

    return headscope.load_model(str(planted_copier), device="cpu", lm_head=True), copied_sentences(24)


@pytest.fixture(scope="module")
def report(planted_gpt2, corpus_lines):
    return headscope.analyze(str(planted_gpt2), corpus_lines, charts=None, page=False, bootstrap=0)


def test_a_cell_escapes_text_and_leaves_missing_numbers_empty():
    assert cell("<script>alert(1)</script>") == "&lt;script&gt;alert(1)&lt;/script&gt;"
    for missing in (float("nan"), np.float32("nan"), None, pd.NA, float("inf")):
        assert cell(missing) == ""
    assert cell(np.float32(0.123456)) == "0.1235" and cell(np.int64(12345)) == "12,345" and cell(True) == "True"
    html = table(["a", "b"], [("x", float("nan"))])
    assert '<td style="padding:2px 8px"></td>' in html and "nan" not in html


def test_the_report_shows_its_roles_and_its_page_isolated(report):
    text = repr(report)
    assert text.startswith("Report(model=") and "layers x" in text and len(text) < 200  # __repr__ stays short
    html = report._repr_html_()
    assert html.count("<iframe") == 1 and "sandbox" not in own_html(html)  # it reads plotly.js from the notebook
    assert "<script" not in own_html(html)  # the page's scripts run in the iframe's document only
    assert "the strongest heads of each role" in html
    for role in report.heads["role"].unique():
        if role != "other":
            assert f">{role}<" in own_html(html)


def test_plotly_travels_once_per_notebook_and_to_html_stands_alone(report):
    first, second = report._repr_html_(), report._repr_html_()
    assert len(HELD_PLOTLY.findall(first)) == 1 and not HELD_PLOTLY.findall(second)
    assert len(first) - len(second) > PLOTLY_MB * 2**20 and len(second) < PLOTLY_MB * 2**20
    alone = report.to_html()  # a view kept as a file: plotly.js inside its page, which needs nothing around it
    assert not HELD_PLOTLY.findall(alone) and 'sandbox="allow-scripts"' in alone and len(alone) > PLOTLY_MB * 2**20
    send_plotly_again()
    assert len(HELD_PLOTLY.findall(report._repr_html_())) == 1


def test_text_from_the_data_is_escaped_and_nan_is_no_value(report):
    heads = report.heads.copy()
    heads["prev_token"] = np.nan  # previous-token heads' evidence
    run = {**report.run, "model": {**report.run["model"], "input": "<script>alert(1)</script>"}}
    html = Report(run, tables={"heads.parquet": heads, "examples.parquet": report.examples})._repr_html_()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in own_html(html) and "<script" not in own_html(html)
    assert "(nan)" not in html and ">nan<" not in html


def test_the_intervention_results_show_their_tables(copier):
    loaded, texts = copier
    ablation = headscope.ablate(loaded, texts, heads=[[(0, 0), (0, 1)]], mode="zero", bootstrap=20)
    assert repr(ablation).startswith("Ablation(model=") and "1 groups" in repr(ablation)
    html = ablation._repr_html_()
    effect = ablation.effects[0]
    assert ">0.0,0.1<" in html and f">{effect.delta:.4g}<" in html and "<iframe" not in html
    pruning = headscope.prune(loaded, texts, budget=0.01, mode="zero")
    html = pruning._repr_html_()
    assert f"{len(pruning.result.heads)} of 8 heads" in html and ", ".join(pruning.heads) in html
    assert repr(pruning).startswith("Pruning(model=") and "heads removed" in repr(pruning)
    pairs = [{"clean": "w1 w1 w1", "corrupt": "w2 w2 w2", "answer": "w1", "distractor": "w2"}]
    patching = headscope.patch(loaded, pairs, bootstrap=0, charts=None)
    html = patching._repr_html_()
    assert "the largest effects" in html and repr(patching).startswith("Patching(model=")
    assert "metric</b> logit_diff = " in html and "{" not in html.split("<table")[0]  # the metric named, not a dict
    strongest = patching.top(1).iloc[0]
    layer, head = int(strongest["layer"]), int(strongest["head"])
    assert f"{strongest['effect']:+.3f}<" in html and f'title="{layer}.{head}: ' in html  # and the heatmap
    inspection = headscope.inspect(loaded, texts=texts[:2], heads=[(0, 0), (1, 2)])
    html = inspection._repr_html_()
    assert html.count("<iframe") == 1 and "<script" not in own_html(html) and "where each head looks" in html
    assert repr(inspection).startswith("Inspection(model=")


@pytest.mark.slow  # starts Chromium
@needs_browser
def test_two_results_in_one_page_each_become_interactive(report, copier, tmp_path):
    """A notebook's output area holds many results: two report views and an inspection in one page, plotly.js held
    once in it, each page ready in its own iframe (charts drawn with that copy), with no console error."""
    from selenium.webdriver.common.by import By

    loaded, texts = copier
    inspection = headscope.inspect(loaded, texts=texts[:2], heads=[(0, 0), (1, 2)])
    page = tmp_path / "notebook.html"
    parts = [report._repr_html_(), report._repr_html_(), inspection._repr_html_()]
    page.write_text("<!doctype html><html><body>" + "".join(f"<div>{p}</div>" for p in parts) + "</body></html>")
    assert len(HELD_PLOTLY.findall(page.read_text())) == 1
    driver = chromium()
    try:
        driver.get_log("browser")
        driver.get(page.resolve().as_uri())
        frames = driver.find_elements(By.TAG_NAME, "iframe")
        assert len(frames) == 3
        for index, frame in enumerate(frames):
            driver.execute_script("arguments[0].scrollIntoView()", frame)  # lazy frames load when seen
            driver.switch_to.frame(frame)
            started = time.perf_counter()
            while driver.execute_script("return document.body && document.body.dataset.ready") != "true":
                assert time.perf_counter() - started < 30, f"iframe {index} never became ready"
                time.sleep(0.05)
            if index < 2:  # the report's heatmap drew in each of the two, independently
                assert driver.execute_script("return document.getElementById('heatmap').data[0].z.length") == 2
            driver.switch_to.default_content()
        assert console_problems(driver) == []
        driver.save_screenshot(str(tmp_path / "notebook.png"))
    finally:
        driver.quit()


@pytest.mark.slow  # starts Chromium
@needs_browser
def test_a_view_whose_notebook_lost_plotly_says_what_to_run_and_a_kept_view_needs_nothing(report, tmp_path):
    """A result shown after the one holding plotly.js, in a page that no longer holds it (its output cleared): the
    frame says how to get it back. A view kept with to_html() draws its heatmap on its own."""
    from selenium.webdriver.common.by import By

    report._repr_html_()  # the output that held plotly.js, since cleared
    lost, kept = tmp_path / "lost.html", tmp_path / "kept.html"
    lost.write_text(f"<!doctype html><html><body>{report._repr_html_()}</body></html>", encoding="utf-8")
    kept.write_text(f"<!doctype html><html><body>{report.to_html()}</body></html>", encoding="utf-8")
    driver = chromium()
    try:
        for page in (lost, kept):
            driver.get(page.resolve().as_uri())
            frame = driver.find_element(By.TAG_NAME, "iframe")
            driver.execute_script("arguments[0].scrollIntoView()", frame)
            driver.switch_to.frame(frame)
            started = time.perf_counter()
            while True:
                text = driver.execute_script("return document.body ? document.body.innerText : ''")
                if page is lost and "send_plotly_again()" in text:
                    break
                if page is kept and driver.execute_script("return document.body.dataset.ready") == "true":
                    assert driver.execute_script("return document.getElementById('heatmap').data[0].z.length") == 2
                    break
                assert time.perf_counter() - started < 30, f"{page.name}: {text[:300]}"
                time.sleep(0.05)
            driver.switch_to.default_content()
    finally:
        driver.quit()


def test_the_notebook_progress_is_one_display_updated_in_place():
    from headscope.run.progress import NotebookReporter

    now = [0.0]
    drawn = []

    class Recorded(NotebookReporter):  # the display seam: what would be drawn, and when
        def _draw(self, force: bool = False) -> None:
            if force or now[0] - self._drawn >= self.interval:
                self._drawn = now[0]
                drawn.append(self.html())

    reporter = Recorded(clock=lambda: now[0])
    reporter.stage("measuring <every> head")
    reporter.start(100, what="corpus")
    for _ in range(10):
        now[0] += 0.1
        reporter.advance(10, 120)
    reporter.note("planned: <3> passes")
    reporter.finish()
    assert len(drawn) == 2 + 3 + 2  # stage, start; 3 of 10 advances (0.1 s apart, drawn 0.25 s apart); note, finish
    last = drawn[-1]
    assert "<progress value='100' max='100'" in last and "corpus: 100/100 sentences" in last
    assert "measuring &lt;every&gt; head" in last and "note: planned: &lt;3&gt; passes" in last
    assert "1,200 tokens/s" in last


@needs_browser
def test_a_script_token_shows_as_text_in_the_notebook_view(smollm2, tmp_path):
    """A text holding markup, inspected on the real SmolLM2: its tokens show as text inside the frame, and nothing
    of it runs (an alert would stop the driver)."""
    from selenium.webdriver.common.by import By

    inspection = headscope.inspect(smollm2, texts=["<script>alert(1)</script> and <b>bold</b>"], heads=[(0, 0)])
    html = inspection._repr_html_()
    assert "<script" not in own_html(html)
    page = tmp_path / "notebook.html"
    page.write_text(f"<!doctype html><html><body>{html}</body></html>", encoding="utf-8")
    driver = chromium()
    try:
        driver.get(page.resolve().as_uri())
        frame = driver.find_element(By.TAG_NAME, "iframe")
        driver.switch_to.frame(frame)
        started = time.perf_counter()
        while driver.execute_script("return document.body && document.body.dataset.ready") != "true":
            assert time.perf_counter() - started < 30, "the inspection view never became ready"
            time.sleep(0.05)
        text = driver.execute_script("return document.body.innerText")
        assert "script" in text and "<" in text  # the tokens, as text
        bold = "return [...document.querySelectorAll('b')].some(e => e.textContent.includes('bold'))"
        assert not driver.execute_script(bold)  # the text's markup never became markup
        driver.switch_to.default_content()
        assert console_problems(driver) == []
    finally:
        driver.quit()


@pytest.mark.slow  # over 1.5 s on two cores
def test_a_report_in_memory_computes_its_example_views_when_first_read(copier, tmp_path):
    """A loaded model analysed without an output folder: the example views' forward pass waits for report.examples
    (forward passes counted at the embeddings), runs once, and gives the table a written report holds."""
    loaded, texts = copier
    forwards = []
    hook = loaded.model.get_input_embeddings().register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        kept = headscope.analyze(loaded, texts, examples=3, probes=False, bootstrap=0)
        measuring = len(forwards)
        first = kept.examples
        assert len(forwards) == measuring + 3  # one forward per example sentence, now
        assert kept.examples is first and len(forwards) == measuring + 3  # read once
        written = headscope.analyze(loaded, texts, out=tmp_path / "r", examples=3, probes=False, bootstrap=0)
    finally:
        hook.remove()
    assert measuring > 0 and first["sentence_id"].nunique() == 3
    pd.testing.assert_frame_equal(first, written.examples)
    pd.testing.assert_frame_equal(kept.heads, written.heads)


def test_example_views_computed_when_first_read_run_with_the_runs_threads(copier):
    """--threads reaches the example views' forward pass even when it runs after `analyze` returned (torch's
    thread count read at the embeddings of each forward), and the caller's count is given back after it."""
    loaded, texts = copier
    started = torch.get_num_threads()
    torch.set_num_threads(2)  # a count --threads 1 differs from, whatever the process started with
    seen = []
    hook = loaded.model.get_input_embeddings().register_forward_pre_hook(
        lambda *_: seen.append(torch.get_num_threads())
    )
    try:
        kept = headscope.analyze(loaded, texts, examples=3, probes=False, bootstrap=0, threads=1)
        measured = len(seen)
        assert torch.get_num_threads() == 2
        views = kept.examples
        assert views["sentence_id"].nunique() == 3
        assert len(seen) == measured + 3 and set(seen[measured:]) == {1}
        assert torch.get_num_threads() == 2
    finally:
        hook.remove()
        torch.set_num_threads(started)
