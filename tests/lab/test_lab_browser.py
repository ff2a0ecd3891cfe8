"""The Engine Lab in headless Chromium, on the default model: one browser, one page, driven as
a learner would, at 1280x800 and on a 390x844 phone, in English and in Chinese.

What it protects: the window never jumps when Plan, Commit or Step is clicked; the
phone gets a one-column layout with no horizontal overflow; narration says what really
changed (a mid-prompt chunk's commit appends nothing); the main scenario's block table is not
[0, 1] (slot != position); a prediction is locked once the result shows, also after a reload;
Play plays the current scenario and Stop stays where it is; actions that cannot run are
disabled with the reason; errors and every word of the zh page use Chinese punctuation.

Skipped when Debian's chromium is missing, unless MINIVLLM_REQUIRE_BROWSER=1 (CI), which
turns the skip into a failure. MINIVLLM_LAB_SCREENSHOT=1 refreshes docs/lab.png and
docs/lab-phone.png.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
DOCS = Path(__file__).resolve().parents[2] / "docs"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# An ASCII punctuation mark touching a CJK character: the zh page must use ，。：；（）！？
MIXED_PUNCT = re.compile(r"[\u3400-\u9fff][,.:;!?()]|[,.:;!?()][\u3400-\u9fff]")


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


@contextmanager
def open_lab_page(lab_url: str):
    """An English desktop page of the lab in its own headless Chromium, loaded and ready;
    the page's JavaScript errors collect in `page.errors`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        context = browser.new_context(locale="en-US", viewport=DESKTOP)
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda exc: page.errors.append(str(exc)))
        page.goto(lab_url)
        page.wait_for_selector('body[data-ready="1"]')
        yield page
        browser.close()


@pytest.fixture(scope="module")
def page(lab_url: str):
    """One English page in one browser, shared by the tests; each test picks its scenario,
    viewport and language. Page errors fail the test that caused them."""
    with open_lab_page(lab_url) as page:
        yield page


def tid(page, name: str):
    return page.get_by_test_id(name)


def expect_fields(page, status: str, scheduled: int, cached: int, tokens: int) -> None:
    from playwright.sync_api import expect

    expect(tid(page, "field-status")).to_have_text(status)
    expect(tid(page, "field-num_scheduled_tokens")).to_have_text(str(scheduled))
    expect(tid(page, "field-num_cached_tokens")).to_have_text(str(cached))
    expect(tid(page, "field-num_tokens")).to_have_text(str(tokens))


def click_in_place(page, name: str) -> None:
    """Click an engine action and check the window did not move (the button is first
    brought into view, so Playwright itself has no reason to scroll)."""
    from playwright.sync_api import expect

    button = tid(page, name)
    button.scroll_into_view_if_needed()
    before = page.evaluate("[scrollX, scrollY]")
    frames = page.evaluate("document.querySelectorAll('.dot').length")
    had_verdict = tid(page, "predict-feedback").count() > 0
    button.click()
    expect(page.locator(".dot")).not_to_have_count(frames)
    page.wait_for_function("!document.body.classList.contains('busy')")
    page.evaluate("new Promise(requestAnimationFrame)")
    if page.evaluate("[scrollX, scrollY]") != before:  # only to show a lesson's new verdict
        assert not had_verdict and verdict_in_view(page), f"{name} moved the window"


def verdict_in_view(page) -> bool:
    """The lesson's verdict starts inside the window (the learner sees the answer arrive)."""
    box = tid(page, "predict-feedback").bounding_box()
    return box is not None and 0 <= box["y"] < page.viewport_size["height"] - 40


def pick_scenario(page, name: str) -> None:
    """Open a scenario as a learner would: its tab, or on a phone (where the other chapters
    fold into a menu) the chapter menu."""
    tab = tid(page, f"scenario-{name}")
    if tab.is_visible():
        tab.click()
    else:
        tid(page, "chapter-menu").select_option(name)
    page.wait_for_function(f"document.querySelector('[data-testid=scenario-{name}].current')")
    page.wait_for_function("!document.body.classList.contains('busy')")


def set_language(page, lang: str) -> None:
    from playwright.sync_api import expect

    if page.evaluate("document.documentElement.lang").startswith(lang):
        return
    tid(page, "lang-toggle").click()
    expect(page.locator("html")).to_have_attribute("lang", re.compile(f"^{lang}"))


def no_horizontal_overflow(page) -> None:
    """Nothing wider than the window, and nothing spilling out of its card."""
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= page.viewport_size["width"], f"page is {width}px wide"
    spilled = page.evaluate(
        """() => [...document.querySelectorAll('.card, .narration')]
          .filter((card) => getComputedStyle(card).display !== 'contents')  // no box of its own
          .flatMap((card) => {
            const box = card.getBoundingClientRect();
            const clipped = (el) => {  // inside a box that scrolls or clips it on purpose
              for (let p = el.parentElement; p && p !== card; p = p.parentElement) {
                if (getComputedStyle(p).overflowX !== 'visible') return true;
              }
              return false;
            };
            return [...card.querySelectorAll('*')].filter((el) => {
              const r = el.getBoundingClientRect();
              return r.width > 0 && (r.right > box.right + 1 || r.left < box.left - 1)
                && !clipped(el);
            }).map((el) => el.className || el.tagName);
          })"""
    )
    assert spilled == [], spilled


def test_seed_experiment_on_the_desktop(page) -> None:
    """The chapter's experiment at 1280x800: predict, Plan Prefill, Commit cache, Step, the
    values at each step, the window still, the slot mapping visible, the prediction locked
    (also after a reload), time travel, the explain check read from the trace."""
    from playwright.sync_api import expect

    page.set_viewport_size(DESKTOP)
    set_language(page, "en")
    pick_scenario(page, "seq8")
    expect_fields(page, "WAITING", 0, 0, 8)
    expect(page.locator("#guide-intro")).to_contain_text(SEQ8_TEXT)
    expect(tid(page, "real-note")).to_contain_text("ModelRunner")
    expect(tid(page, "btn-commit")).to_be_disabled()
    expect(tid(page, "btn-commit").locator("..")).to_have_attribute("title", re.compile("Plan"))
    tid(page, "predict-choice-num_cached_tokens").click()

    click_in_place(page, "btn-plan")
    expect_fields(page, "RUNNING", 8, 0, 8)
    if os.environ.get("MINIVLLM_LAB_SCREENSHOT") == "1" or not (DOCS / "lab.png").exists():
        page.evaluate("scrollTo(0, 0)")
        page.screenshot(path=str(DOCS / "lab.png"), full_page=True)
    # An earlier request finished first: the Sequence's blocks are not 0 and 1.
    expect(tid(page, "block-table")).to_have_attribute("data-value", "[2,3]")
    slot0 = page.locator("#slot-table tbody tr").first.locator(".slot-cell")
    expect(slot0).to_have_text("8")
    expect(tid(page, "kv-slot-8")).to_have_class(re.compile(r"\bplanned\b"))
    expect(tid(page, "budget")).to_have_text("8 / 64")
    expect(tid(page, "event-log")).to_contain_text("Scheduler.schedule")
    expect(tid(page, "narr-story")).to_contain_text("8 tokens planned")
    # The result is on screen: the prediction is locked.
    expect(tid(page, "predict-feedback")).to_have_class(re.compile(r"\bok\b"))
    expect(tid(page, "predict-choice-num_tokens")).to_be_disabled()
    page.evaluate("document.querySelector('[data-testid=predict-choice-num_tokens]').click()")
    expect(tid(page, "predict-choice-num_cached_tokens")).to_have_class(re.compile(r"\bchosen\b"))

    click_in_place(page, "btn-commit")
    expect_fields(page, "RUNNING", 0, 8, 9)
    expect(tid(page, "narr-story")).to_contain_text("the sampled token appended, num_tokens 8 → 9")
    expect(tid(page, "kv-slot-8")).to_have_class(re.compile(r"\bcommitted\b"))
    expect(tid(page, "code-pane")).to_contain_text("def ")
    tid(page, "owner-num_prompt_tokens").click()  # the fields written at creation
    expect(tid(page, "code-pane")).to_contain_text("def __init__")

    click_in_place(page, "btn-step")
    expect_fields(page, "RUNNING", 0, 9, 10)
    expect(tid(page, "block-table")).to_have_attribute("data-value", "[2,3,4]")
    expect(tid(page, "frame-action")).to_have_text("Step: decode")

    # Time travel: one frame back is the Step's execute phase (KV written, not committed);
    # the engine's actions wait for the live frame, and say so.
    tid(page, "btn-back").click()
    expect_fields(page, "RUNNING", 1, 8, 9)
    expect(tid(page, "kv-slot-16")).to_have_class(re.compile(r"\bwritten\b"))
    expect(tid(page, "btn-plan")).to_be_disabled()
    expect(tid(page, "run-why")).to_contain_text("viewing the past")
    tid(page, "btn-live").click()
    expect(tid(page, "btn-forward")).to_be_disabled()

    # Explain: the phase in which each field grew, checked against the trace.
    for field, phase in [
        ("num_scheduled_tokens", "plan"),
        ("num_cached_tokens", "commit"),
        ("num_tokens", "commit"),
    ]:
        tid(page, f"grow-{field}").select_option(phase)
    tid(page, "btn-check").click()
    for field in ["num_scheduled_tokens", "num_cached_tokens", "num_tokens"]:
        expect(tid(page, f"grow-result-{field}")).to_have_class(re.compile(r"\bok\b"))
    tid(page, "relation-choice-plan").click()
    expect(tid(page, "relation-feedback")).to_contain_text("Yes.")
    tid(page, "explain-sentence").fill("The plan sets state, execute writes KV, commit caches.")
    expect(tid(page, "word-checklist").locator("li.done")).to_have_count(4)
    tid(page, "kv-slot-13").click()
    expect(tid(page, "slot-info")).to_contain_text("seq 1, position 5")

    # A reload keeps the locked prediction and the sentence.
    page.reload()
    page.wait_for_selector('body[data-ready="1"]')
    expect(tid(page, "predict-choice-num_cached_tokens")).to_have_class(re.compile(r"\bchosen\b"))
    expect(tid(page, "predict-choice-num_tokens")).to_be_disabled()
    expect(tid(page, "explain-sentence")).to_have_value(re.compile("commit caches"))

    tid(page, "timeline").fill("8")  # the lesson's moment: RUNNING, scheduled 8, cached 0
    expect_fields(page, "RUNNING", 8, 0, 8)
    no_horizontal_overflow(page)
    assert page.errors == []


def test_phone_layout_chunked_narration_and_chinese(page) -> None:
    """On a 390x844 phone: one column, no horizontal overflow, the window still; the chunked
    prefill's mid-prompt commit appends nothing and says so; in Chinese no ASCII punctuation
    touches a CJK character, errors are Chinese, and a Chinese prompt's split characters show
    as bytes instead of U+FFFD."""
    from playwright.sync_api import expect

    page.set_viewport_size(PHONE)
    set_language(page, "en")
    pick_scenario(page, "chunked")
    tid(page, "predict-choice-8").click()
    no_horizontal_overflow(page)
    page.evaluate("scrollTo(0, 200)")
    click_in_place(page, "btn-plan")
    click_in_place(page, "btn-commit")
    expect_fields(page, "RUNNING", 0, 8, 20)
    story = tid(page, "narr-story")
    expect(story).to_contain_text("no token added")
    expect(story).not_to_contain_text("append")
    no_horizontal_overflow(page)
    if os.environ.get("MINIVLLM_LAB_SCREENSHOT") == "1" or not (DOCS / "lab-phone.png").exists():
        page.evaluate("scrollTo(0, document.querySelector('#flow-run').offsetTop - 8)")
        page.screenshot(path=str(DOCS / "lab-phone.png"))

    set_language(page, "zh")
    expect(tid(page, "narr-story")).to_contain_text("没有新增 token")
    click_in_place(page, "btn-step")
    expect(tid(page, "frame-action")).to_have_text("单步：prefill 分块")
    texts = [page.inner_text("body")]
    for name in ["seq8", "prefix", "preempt", "finish"]:
        pick_scenario(page, name)
        expect(tid(page, f"scenario-{name}")).to_have_class(re.compile(r"\bcurrent\b"))
        texts.append(page.inner_text("body"))
        click_in_place(page, "btn-plan")
        click_in_place(page, "btn-commit")
        texts.append(page.inner_text("body"))
        no_horizontal_overflow(page)
    expect(tid(page, "btn-plan")).to_contain_text("计划")
    mixed = sorted({m for text in texts for m in MIXED_PUNCT.findall(text)})
    assert mixed == [], mixed

    page.locator(".add-card summary").click()
    tid(page, "add-prompt").fill("   ")
    tid(page, "btn-add").click()
    expect(tid(page, "toast")).to_contain_text("prompt 是空的")
    tid(page, "add-prompt").fill("你好，世界")
    tid(page, "btn-add").click()
    expect(page.locator("#tokens")).to_contain_text("<0xE4><0xBD>")
    expect(page.locator("#tokens")).to_contain_text("你")
    assert "\ufffd" not in page.inner_text("#tokens")
    set_language(page, "en")
    assert page.errors == []


def test_other_scenarios_and_play(page) -> None:
    """The prefix hit shows cached > 0 right after Plan; preemption sends seq 1 back to
    WAITING; FINISHED disables Plan and Step with the reason; Play plays the current scenario
    (it is not reset, its progress is kept) and Stop leaves the view where it is. At 1440 px
    (three columns) nothing spills out of its card."""
    from playwright.sync_api import expect

    page.set_viewport_size({"width": 1440, "height": 900})
    set_language(page, "en")
    pick_scenario(page, "prefix")
    tid(page, "predict-choice-12").click()
    tid(page, "btn-plan").click()
    expect(tid(page, "field-num_cached_tokens")).to_have_text("12")
    expect(tid(page, "predict-feedback")).to_have_class(re.compile(r"\bok\b"))
    expect(tid(page, "kv-block-0")).to_contain_text("ref 2")
    expect(tid(page, "narr-story")).to_contain_text("a prefix hit")

    pick_scenario(page, "preempt")
    tid(page, "predict-choice-waiting").click()
    tid(page, "btn-plan").click()
    expect(tid(page, "field-status")).to_have_text("WAITING")
    expect(tid(page, "block-table")).to_have_attribute("data-value", "[]")
    expect(tid(page, "narr-story")).to_contain_text("preempted")

    pick_scenario(page, "finish")
    for action in ["btn-plan", "btn-commit", "btn-step"]:
        tid(page, action).click()
    expect(tid(page, "field-status")).to_have_text("FINISHED")
    expect(tid(page, "finished-note")).to_contain_text("num_tokens − 1")
    expect(tid(page, "btn-plan")).to_be_disabled()
    expect(tid(page, "btn-step")).to_be_disabled()
    expect(tid(page, "run-why")).to_contain_text("FINISHED")
    no_horizontal_overflow(page)

    # Play in the chunked scenario after one Plan: it keeps the scenario and the plan.
    pick_scenario(page, "chunked")
    tid(page, "btn-plan").click()
    expect_fields(page, "RUNNING", 8, 0, 20)
    tid(page, "btn-play").click()
    expect(tid(page, "btn-play")).to_have_class(re.compile(r"\bon\b"))
    expect(tid(page, "field-num_cached_tokens")).to_have_text("16", timeout=30_000)
    tid(page, "btn-play").click()  # Stop: the view stays on the frame shown
    expect(tid(page, "btn-play")).not_to_have_class(re.compile(r"\bon\b"))
    expect(tid(page, "scenario-chunked")).to_have_class(re.compile(r"\bcurrent\b"))
    shown = tid(page, "frame-label").inner_text()
    page.wait_for_timeout(1500)
    assert tid(page, "frame-label").inner_text() == shown
    history = page.evaluate("fetch('/api/lab/history').then(r => r.json())")["frames"]
    assert history[-1]["scenario"] == "chunked"
    assert [f["frame"]["action"] for f in history].count("plan") >= 2  # the learner's + Play's

    # A scenario tab clicked during Play stops it and switches.
    tid(page, "btn-play").click()
    pick_scenario(page, "seq8")
    expect(tid(page, "scenario-seq8")).to_have_class(re.compile(r"\bcurrent\b"))
    expect(tid(page, "btn-play")).not_to_have_class(re.compile(r"\bon\b"))
    expect_fields(page, "WAITING", 0, 0, 8)
    assert page.errors == []
