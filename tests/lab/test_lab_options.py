"""Chapters 04-07 under any engine options the page offers: no option set makes the lab answer
a 5xx, and every verdict is built from the frames it explains, in both languages.

The verdict's words are rendered here as the page renders them (`fillWords` in core.js: a
`{name}` filled in, `{name|one|other}` by count), from the page's own word files, so a missing
word, an empty placeholder or a "1 tokens" shows up without a browser.
"""

from __future__ import annotations

import itertools
import json
import re
from functools import partial
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.fake_lab import fake_lab_engine

from minivllm.lab.app import create_app
from minivllm.lab.chapters import SCENARIOS

STATIC = Path(__file__).resolve().parents[2] / "minivllm" / "lab" / "static"
LESSONS = [name for name, s in SCENARIOS.items() if s.chapter >= "04"]
SINGULAR_AS_PLURAL = re.compile(r"\b1 (tokens|blocks|sequences|slots|drafts|steps|rows|were)\b")


def words(lang: str) -> dict[str, str]:
    """The page's words of `lang` that are plain strings (words_en.js / words_zh.js)."""
    text = (STATIC / f"words_{lang}.js").read_text()
    found = re.findall(r'^  (\w+): (".*"),$', text, flags=re.M)
    return {key: json.loads(value) for key, value in found}


WORDS = {"en": words("en"), "zh": words("zh")}


def fill(text: str, params: dict) -> str:
    """core.js's fillWords."""
    text = re.sub(
        r"\{(\w+)\|([^|}]*)\|([^}]*)\}",
        lambda m: m.group(2) if str(params.get(m.group(1))) == "1" else m.group(3),
        text,
    )
    return re.sub(r"\{(\w+)\}", lambda m: str(params.get(m.group(1), "")), text)


def say(item: dict, lang: str) -> str:
    """One story line in the page's words (lesson.js's storyText)."""
    w = WORDS[lang]
    assert item["key"] in w, f"no {lang} word for {item['key']}"
    params = dict(item["params"])
    for name in ("kind", "reason"):
        if name in params:
            params[name] = w[f"{name}_{params[name]}"]
    return fill(w[item["key"]], params)


def check_words(result: dict) -> dict[str, str]:
    """The verdict's text in each language: every number of every line named, no gaps."""
    texts = {}
    for lang in ("en", "zh"):
        lines = [*result["story"], *([result["premise"]] if result["premise"] else [])]
        assert lines, result
        text = " ".join(say(item, lang) for item in lines)
        for item in lines:
            for value in item["params"].values():
                if isinstance(value, int):
                    assert str(value) in say(item, lang), (item, lang)
        assert "{" not in text and "[]" not in text and "undefined" not in text, text
    if result["inputs"] is not None:  # the pinned table's caption names its step
        assert isinstance(result["params"]["step"], int), result["params"]
        assert not SINGULAR_AS_PLURAL.search(text), text
        texts[lang] = text
    return texts


def post(client: TestClient, path: str, body: object = None) -> tuple[int, dict]:
    r = client.post(f"/api/lab/{path}", json=body)
    assert r.status_code < 500, (path, body, r.text)
    return r.status_code, r.json()


def drive(client: TestClient, name: str, options: dict, frames: list | None = None) -> dict | None:
    """Reset `name` with `options` and Plan / Commit until the lesson answers: the result, or
    None when the options were refused with a clear message or the run ended unanswered.
    `frames` collects the frames the learner's clicks recorded."""
    status, state = post(client, "reset", {"scenario": name, **options})
    if status != 200:
        assert state["code"] and state["error"], state
        return None
    for action in itertools.islice(itertools.cycle(["plan", "commit"]), 60):
        status, state = post(client, action)
        if status != 200:
            assert state["code"] in ("all_finished", "nothing_fits"), state
            return None
        if frames is not None:
            frames += state["frames"]
        if state["lesson"]["result"] is not None:
            return state["lesson"]["result"]
    return None


@pytest.fixture(scope="module")
def clients() -> dict[int, TestClient]:
    """The lab on the fake runner at block sizes 2, 4 (the page's) and 8."""
    return {
        bs: TestClient(
            create_app(partial(fake_lab_engine, block_size=bs)), raise_server_exceptions=False
        )
        for bs in (2, 4, 8)
    }


BUDGETS = [1, 2, 16, 20, None]
SEQS = [1, 2, 4, None]


@pytest.mark.parametrize("name", LESSONS)
def test_no_option_set_breaks_a_lesson(clients: dict[int, TestClient], name: str) -> None:
    """Every budget x max_num_seqs the panel offers (and small/large pools, block sizes 2 and
    8): no 5xx (chapter 06 once answered 500 at budget 1), and whenever the engine answers,
    the verdict names its numbers in English and Chinese with no gaps or false plurals."""
    grid = [
        ({"max_num_batched_tokens": b, "max_num_seqs": s}, 4)
        for b, s in itertools.product(BUDGETS, SEQS)
    ]
    grid += [({"num_kv_blocks": n}, 4) for n in (4, 8, 64)]
    grid += [({}, 2), ({}, 8), ({"max_num_batched_tokens": 16}, 8)]
    answered = 0
    for options, bs in grid:
        options = {k: v for k, v in options.items() if v is not None}
        result = drive(clients[bs], name, options)
        if result is not None:
            check_words(result)
            answered += 1
    assert answered >= len(grid) // 2, f"{name}: only {answered} of {len(grid)} runs answered"


# scenario: options under which its situation does not arise, and the line that says so
PREMISE_FAILS = {
    "budget": ({"max_num_batched_tokens": 20}, "pre_budget_fits"),
    "chunks": ({"max_num_batched_tokens": 64}, "pre_chunks_none"),
    "max_seqs": ({"max_num_seqs": 4}, "pre_seqs_none"),
    "victim": ({"num_kv_blocks": 8}, "pre_victim_none"),
    "chain": ({"max_num_batched_tokens": 4}, "pre_not_admitted"),
    "reuse": ({"max_num_seqs": 1}, "pre_not_admitted"),
    "partial": ({"max_num_batched_tokens": 4}, "pre_not_admitted"),
    "lru": ({"num_kv_blocks": 4}, "pre_not_admitted"),
    "slot": ({"max_num_batched_tokens": 2}, "pre_not_first"),
    "read": ({"max_num_batched_tokens": 1}, "pre_read_prefill"),
    "logits": ({"max_num_batched_tokens": 64}, "pre_logits_whole"),
}
OTHER = {"max_num_batched_tokens": 16, "num_kv_blocks": 8}


def check_plan_lines(result: dict, frames: list[dict]) -> None:
    """Each "seq N: k tokens" / "seq N: nothing" line says what the first plan frame shows."""
    plan = next(f for f in frames if f["frame"]["stage"] == "plan")
    scheduled = {s["seq_id"]: s["num_scheduled_tokens"] for s in plan["sequences"]}
    for item in result["story"]:
        if item["key"] == "l_sched":
            assert scheduled[item["params"]["seq"]] == item["params"]["n"], item
        if item["key"] == "l_none":
            assert scheduled[item["params"]["seq"]] == 0, item


@pytest.mark.parametrize("name", LESSONS)
def test_the_verdict_says_when_the_lesson_did_not_arise(
    clients: dict[int, TestClient], name: str
) -> None:
    """Under the scenario's own options the lesson's situation arises and the page tells its
    rule; under options where it cannot (nobody waits, nobody is preempted, no prompt cut)
    the page says so and names options under which it does, instead of the default story;
    under a third set the text still holds. The engine's answer is in the verdict each time,
    and the per-sequence lines match the plan frame."""
    client = clients[4]
    fails = PREMISE_FAILS.get(name)
    runs = [({}, None), (OTHER, "any"), *([fails] if fails else [])]
    for options, premise in runs:
        frames: list[dict] = []
        result = drive(client, name, options, frames)
        assert result is not None, (name, options)
        check_words(result)
        check_plan_lines(result, frames)
        if premise is None:
            assert result["premise"] is None, (name, result["premise"])
        elif premise != "any":
            assert result["premise"]["key"] == premise, (name, options, result["premise"])
    if name == "spec":  # the chapter's lesson: a draft written and never committed
        result = drive(client, name, {})
        assert any(line["key"] == "spec_rejected" for line in result["story"])
