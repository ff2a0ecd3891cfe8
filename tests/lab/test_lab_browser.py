"""The Engine Lab in headless Chromium, on the default model: the seed's experiment clicked
through in English and in Chinese (predict, Plan Prefill, Commit cache, Decode, explain),
the DOM values checked at every step, time travel, a KV slot lookup, and a screenshot.

Skipped when Debian's chromium is missing, unless MINIVLLM_REQUIRE_BROWSER=1 (CI), which
turns the skip into a failure. MINIVLLM_LAB_SCREENSHOT=1 refreshes docs/lab.png.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from minivllm.lab.app import create_app
from minivllm.lab.scenarios import SEQ8_TEXT

pytestmark = pytest.mark.default_model

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS_SHOT = Path(__file__).resolve().parents[2] / "docs" / "lab.png"


def _need_browser() -> None:
    problem = None
    if not Path(CHROMIUM).exists():
        problem = f"chromium not found at {CHROMIUM}"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "python playwright is not installed"
    if problem is None:
        return
    if os.environ.get("MINIVLLM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"MINIVLLM_REQUIRE_BROWSER=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="module")
def lab_url() -> Iterator[str]:
    """The lab on the default model, served by uvicorn on a free loopback port."""
    _need_browser()
    import uvicorn

    from minivllm.lab.engines import default_engines

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(default_engines(None, 4))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the lab server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(lab_url: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def open_page(browser, url: str, locale: str):
    context = browser.new_context(locale=locale, viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_selector('body[data-ready="1"]')
    return page, errors


def expect_fields(page, status: str, scheduled: int, cached: int, tokens: int) -> None:
    from playwright.sync_api import expect

    expect(page.get_by_test_id("field-status")).to_have_text(status)
    expect(page.get_by_test_id("field-num_scheduled_tokens")).to_have_text(str(scheduled))
    expect(page.get_by_test_id("field-num_cached_tokens")).to_have_text(str(cached))
    expect(page.get_by_test_id("field-num_tokens")).to_have_text(str(tokens))
    expect(page.get_by_test_id("field-num_prompt_tokens")).to_have_text("8")


def run_seed_experiment(page, plan_label: str, commit_label: str) -> None:
    """Predict -> Plan Prefill -> Commit cache -> Decode, with the seed's values at each step."""
    from playwright.sync_api import expect

    page.get_by_test_id("scenario-seq8").click()
    expect_fields(page, "WAITING", 0, 0, 8)
    expect(page.get_by_test_id("block-table")).to_have_attribute("data-value", "[]")
    page.get_by_test_id("predict-choice-num_cached_tokens").click()
    expect(page.get_by_test_id("predict-choice-num_cached_tokens")).to_have_class(
        re.compile(r"\bchosen\b")
    )

    expect(page.get_by_test_id("btn-plan")).to_contain_text(plan_label)
    expect(page.get_by_test_id("btn-commit")).to_be_disabled()
    page.get_by_test_id("btn-plan").click()
    expect_fields(page, "RUNNING", 8, 0, 8)
    expect(page.get_by_test_id("block-table")).to_have_attribute("data-value", "[0,1]")
    expect(page.get_by_test_id("budget")).to_have_text("8 / 64")
    expect(page.get_by_test_id("event-log")).to_contain_text("Scheduler.schedule")
    expect(page.get_by_test_id("event-log")).to_contain_text("scheduler.py:")
    src = page.locator(".ev-src").first.get_attribute("title")
    assert re.fullmatch(r"minivllm/engine/scheduler\.py:\d+", src or ""), src
    expect(page.get_by_test_id("kv-slot-0")).to_have_class(re.compile(r"\bplanned\b"))
    expect(page.get_by_test_id("btn-plan")).to_be_disabled()

    expect(page.get_by_test_id("btn-commit")).to_contain_text(commit_label)
    page.get_by_test_id("btn-commit").click()
    expect_fields(page, "RUNNING", 0, 8, 9)
    expect(page.get_by_test_id("kv-slot-0")).to_have_class(re.compile(r"\bcommitted\b"))
    expect(page.get_by_test_id("event-log")).to_contain_text("ModelRunner.run")
    expect(page.get_by_test_id("event-log")).to_contain_text("Scheduler.postprocess")
    expect(page.get_by_test_id("code-pane")).to_contain_text("def ")

    page.get_by_test_id("btn-decode").click()
    expect_fields(page, "RUNNING", 0, 9, 10)
    expect(page.get_by_test_id("block-table")).to_have_attribute("data-value", "[0,1,2]")
    expect(page.get_by_test_id("predict-feedback")).to_have_class(re.compile(r"\bok\b"))

    # Time travel: one frame back is the Decode's execute phase (KV written, not committed).
    page.get_by_test_id("btn-back").click()
    expect_fields(page, "RUNNING", 1, 8, 9)
    expect(page.get_by_test_id("kv-slot-8")).to_have_class(re.compile(r"\bwritten\b"))
    page.get_by_test_id("btn-back").click()
    page.get_by_test_id("btn-back").click()
    expect_fields(page, "RUNNING", 0, 8, 9)
    page.get_by_test_id("timeline").fill("1")
    expect_fields(page, "RUNNING", 8, 0, 8)
    for _ in range(5):
        page.get_by_test_id("btn-forward").click()
    expect_fields(page, "RUNNING", 0, 9, 10)
    expect(page.get_by_test_id("btn-forward")).to_be_disabled()

    # Explain: each action matched with the field it changed, and the seed's question.
    for action, field in [
        ("plan", "num_scheduled_tokens"),
        ("commit", "num_cached_tokens"),
        ("decode", "num_tokens"),
    ]:
        page.get_by_test_id(f"match-{action}").select_option(field)
    page.get_by_test_id("btn-check").click()
    for action in ["plan", "commit", "decode"]:
        expect(page.get_by_test_id(f"match-result-{action}")).to_have_class(re.compile(r"\bok\b"))
    page.get_by_test_id("relation-choice-running").click()
    expect(page.get_by_test_id("relation-feedback")).to_have_class(re.compile(r"\bbad\b"))
    page.get_by_test_id("relation-choice-plan").click()
    expect(page.get_by_test_id("relation-feedback")).to_have_class(re.compile(r"\bok\b"))

    # A KV slot says which sequence and position it holds.
    page.get_by_test_id("kv-slot-5").click()
    expect(page.get_by_test_id("slot-info")).to_contain_text("5")


def test_seed_experiment_in_english(browser, lab_url: str, tmp_path: Path) -> None:
    """English by default for an English browser; the whole experiment, then a screenshot."""
    from playwright.sync_api import expect

    page, errors = open_page(browser, lab_url, "en-US")
    expect(page.get_by_test_id("lang-toggle")).to_have_text("中文")
    run_seed_experiment(page, "Plan Prefill", "Commit cache")
    expect(page.get_by_test_id("relation-feedback")).to_contain_text("Yes.")
    expect(page.locator("#guide-intro")).to_contain_text(SEQ8_TEXT)
    expect(page.get_by_test_id("real-note")).to_contain_text("ModelRunner")
    expect(page.get_by_test_id("slot-info")).to_contain_text("seq 0, position 5")

    page.get_by_test_id("timeline").fill("1")  # the lesson's moment: RUNNING, cached 0
    page.get_by_test_id("kv-slot-5").click()
    expect_fields(page, "RUNNING", 8, 0, 8)
    page.screenshot(path=str(tmp_path / "lab-en.png"), full_page=True)
    if os.environ.get("MINIVLLM_LAB_SCREENSHOT") == "1" or not DOCS_SHOT.exists():
        DOCS_SHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(DOCS_SHOT), full_page=True)

    page.get_by_test_id("lang-toggle").click()
    expect(page.get_by_test_id("btn-plan")).to_contain_text("计划")
    expect(page.get_by_test_id("lang-toggle")).to_have_text("English")
    assert page.evaluate("document.documentElement.lang") == "zh-CN"
    assert errors == []


def test_seed_experiment_in_chinese(browser, lab_url: str, tmp_path: Path) -> None:
    """Chinese by default for a zh-CN browser; the same experiment with the seed's button
    names; switching back to English keeps the values."""
    from playwright.sync_api import expect

    page, errors = open_page(browser, lab_url, "zh-CN")
    expect(page.get_by_test_id("lang-toggle")).to_have_text("English")
    run_seed_experiment(page, "计划 Prefill", "提交缓存")
    expect(page.get_by_test_id("relation-feedback")).to_contain_text("对。")
    expect(page.get_by_test_id("slot-info")).to_contain_text("序列 0，位置 5")
    page.screenshot(path=str(tmp_path / "lab-zh.png"), full_page=True)

    page.get_by_test_id("lang-toggle").click()
    expect(page.get_by_test_id("btn-plan")).to_contain_text("Plan")
    expect_fields(page, "RUNNING", 0, 9, 10)
    assert errors == []


def test_other_scenarios_and_play(browser, lab_url: str) -> None:
    """Each scenario loads with its own question; the prefix hit shows cached > 0 right
    after Plan; Play replays one Sequence to FINISHED."""
    from playwright.sync_api import expect

    page, errors = open_page(browser, lab_url, "en-US")
    page.get_by_test_id("scenario-prefix").click()
    page.get_by_test_id("predict-choice-12").click()
    page.get_by_test_id("btn-plan").click()
    expect(page.get_by_test_id("field-num_cached_tokens")).to_have_text("12")
    expect(page.get_by_test_id("predict-feedback")).to_have_class(re.compile(r"\bok\b"))
    expect(page.get_by_test_id("kv-block-0")).to_contain_text("ref 2")

    page.get_by_test_id("scenario-preempt").click()
    page.get_by_test_id("predict-choice-waiting").click()
    page.get_by_test_id("btn-plan").click()
    expect(page.get_by_test_id("field-status")).to_have_text("WAITING")
    expect(page.get_by_test_id("block-table")).to_have_attribute("data-value", "[]")
    expect(page.get_by_test_id("predict-feedback")).to_have_class(re.compile(r"\bok\b"))

    for name in ["chunked", "finish"]:
        page.get_by_test_id(f"scenario-{name}").click()
        expect(page.get_by_test_id(f"scenario-{name}")).to_have_class(re.compile(r"\bcurrent\b"))

    page.get_by_test_id("btn-play").click()  # resets seq8 and runs it to FINISHED, then replays
    expect(page.get_by_test_id("btn-play")).to_have_class(re.compile(r"\bon\b"))
    expect(page.get_by_test_id("scenario-seq8")).to_have_class(re.compile(r"\bcurrent\b"))
    expect(page.get_by_test_id("field-status")).to_have_text("WAITING", timeout=30_000)
    page.get_by_test_id("btn-play").click()  # stop: the view jumps to the latest frame
    expect(page.get_by_test_id("field-status")).to_have_text("FINISHED", timeout=30_000)
    expect(page.get_by_test_id("btn-forward")).to_be_disabled()
    assert errors == []
