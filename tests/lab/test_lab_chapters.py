"""Chapters 04-06 over the JSON API, on the fake runner: each scenario's question is graded
on what the engine really did. Every test checks the fact itself in the frames (the plan's
scheduled tokens, a block's ref_count, the runner's slot_mapping), then that a wrong
prediction is graded wrong and the right one right, with the numbers the explanation names.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from minivllm.lab.app import create_app
from minivllm.lab.chapters import SCENARIOS

BS = 4  # the fake lab engine's block_size (conftest.py)


def post(client: TestClient, path: str, body: object = None, status: int = 200) -> dict:
    r = client.post(f"/api/lab/{path}", json=body)
    assert r.status_code == status, r.text
    return r.json()


def play(
    client: TestClient, name: str, answer: str, actions: list[str], **options: int
) -> tuple[dict, list[dict]]:
    """Reset `name`, lock `answer`, run `actions`; the lesson then, and the learner's frames."""
    start = post(client, "reset", {"scenario": name, **options})
    assert start["lesson"]["result"] is None and start["lesson"]["prediction"] is None
    locked = post(client, "predict", {"answer": answer})["lesson"]
    assert locked["prediction"] == answer
    assert post(client, "predict", {"answer": answer}, status=409)["code"] == "prediction_locked"
    frames: list[dict] = []
    state = start
    for action in actions:
        state = post(client, action)
        frames += state["frames"]
    return state["lesson"], frames


def graded(
    client: TestClient, name: str, wrong: str, right: str, actions: list[str], **options: int
) -> tuple[dict, list[dict]]:
    """A wrong prediction is graded wrong, the right one right; both see the same answer."""
    lesson, _ = play(client, name, wrong, actions, **options)
    assert lesson["result"]["correct"] is False and lesson["result"]["answer"] == right
    lesson, frames = play(client, name, right, actions, **options)
    assert lesson["result"]["correct"] is True and lesson["result"]["answer"] == right
    return lesson, frames


def said(lesson: dict, key: str) -> dict:
    """The numbers of the explanation's line `key` (built from the frames, see story.py)."""
    result = lesson["result"]
    lines = [*result["story"], *([result["premise"]] if result["premise"] else [])]
    return next(line["params"] for line in lines if line["key"] == key)


def stage(frames: list[dict], name: str) -> dict:
    return next(f for f in frames if f["frame"]["stage"] == name)


def scheduled(frame: dict) -> list[int]:
    return [s["num_scheduled_tokens"] for s in frame["sequences"]]


# ---- the chapter list ------------------------------------------------------------------------


def test_scenarios_carry_their_chapter_and_code_links(lab_client: TestClient) -> None:
    """The page groups tabs by the server's chapters; each chapter's code links open in the
    code pane on a real function of our source."""
    listed = lab_client.get("/api/lab/scenarios").json()
    by_chapter: dict[str, list[str]] = {}
    for s in listed["scenarios"]:
        by_chapter.setdefault(s["chapter"], []).append(s["name"])
    assert list(by_chapter) == ["03", "04", "05", "06", "07"]
    assert by_chapter["04"] == ["budget", "chunks", "max_seqs", "victim"]
    assert by_chapter["05"] == ["chain", "reuse", "partial", "lru"]
    assert by_chapter["06"] == ["slot", "read", "logits"]
    assert by_chapter["07"] == ["spec"]
    assert [c["chapter"] for c in listed["chapters"]] == ["03", "04", "05", "06", "07"]
    names = set()
    for chapter in listed["chapters"]:
        for link in chapter["code"]:
            r = lab_client.get("/api/lab/source", params={"location": link["location"]})
            assert r.status_code == 200, link
            assert r.json()["function"] == link["function"]
            names.add(link["function"])
    assert {
        "Scheduler.schedule",
        "BlockManager.match_prefix",
        "hash_block",
        "slot_mapping_for",
        "prepare_inputs",
        "ModelRunner.run",
        "NgramProposer.propose",
        "Scheduler._propose_all",
    } <= names


# ---- 04 · Scheduler ----------------------------------------------------------------------


def test_budget_goes_to_decodes_first_then_the_waiting_prompt(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "budget", "8", "6", ["plan"])
    assert scheduled(stage(frames, "plan")) == [1, 1, 6]  # two decodes, then what is left
    assert lesson["question"] == {
        "budget": 8,
        "prompt": 10,
        "c": 2,
        "running": 2,
        "decoding": 2,
        "prefilling": 0,
        "variant": "decoding",
    }
    assert said(lesson, "budget_sum") == {"budget": 8, "used": 2, "left": 6, "c": 2, "got": 6}
    assert said(lesson, "budget_rest") == {"rest": 4} and lesson["result"]["premise"] is None
    # The learner's own budget: 20 leaves room for the whole prompt, and the page says so.
    lesson, frames = play(lab_client, "budget", "10", ["plan"], max_num_batched_tokens=20)
    assert scheduled(stage(frames, "plan")) == [1, 1, 10] and lesson["result"]["correct"]
    assert said(lesson, "pre_budget_fits") == {"c": 2, "need": 11}


def test_chunks_a_prompt_where_the_budget_ends(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "chunks", "1", "2", ["step", "plan", "commit"])
    plans = [scheduled(f) for f in frames if f["frame"]["stage"] == "plan"]
    assert plans == [[10, 2], [1, 4]]  # Q: a 2-token chunk, then its last 4 after P's decode
    splits = [line["params"]["split"] for line in lesson["result"]["story"][:2]]
    assert splits == ["seq 0: 10 + seq 1: 2", "seq 0: 1 + seq 1: 4"]
    assert said(lesson, "chunks_done") == {"q": 1, "steps": 2}


def test_max_num_seqs_leaves_a_prompt_waiting_with_budget_left(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "max_seqs", "3", "2", ["plan"])
    plan = stage(frames, "plan")
    assert scheduled(plan) == [4, 4, 0] and plan["waiting"] == [2]
    assert lesson["result"]["params"]["left"] == 56
    assert said(lesson, "l_none") == {"seq": 2, "reason": "seqs"}
    lesson, _ = play(lab_client, "max_seqs", "3", ["plan"], max_num_seqs=3)
    assert lesson["result"]["correct"] is True
    assert said(lesson, "pre_seqs_none") == {"n": 3, "most": 3, "need": 2}


def test_preemption_sends_back_the_most_recently_admitted(lab_client: TestClient) -> None:
    start = post(lab_client, "reset", {"scenario": "victim"})
    assert start["lesson"]["choices"] == ["0", "1", "2", "none"] and start["num_free_blocks"] == 0
    lesson, frames = graded(lab_client, "victim", "0", "2", ["plan"])
    plan = stage(frames, "plan")
    a, b, c = plan["sequences"]
    assert (a["status"], b["status"], c["status"]) == ("RUNNING", "RUNNING", "WAITING")
    assert c["num_cached_tokens"] == 0 and c["block_table"] == []  # its progress is gone
    freed = ", ".join(
        map(str, post(lab_client, "reset", {"scenario": "victim"})["sequences"][2]["block_table"])
    )
    assert said(lesson, "victim_done") == {"victim": 2, "lost": 2 * BS - 1, "blocks": freed, "n": 2}
    # With more blocks nobody is preempted, and the page says which pool would preempt.
    lesson, _ = play(lab_client, "victim", "none", ["plan"], num_kv_blocks=8)
    assert lesson["result"]["correct"] is True
    assert said(lesson, "pre_victim_none") == {"free": 2, "n": 8, "need": 6}


# ---- 05 · BlockManager and the prefix cache -------------------------------------------------


def test_block_hashes_are_chained(lab_client: TestClient) -> None:
    """B's blocks 2 and 3 hold A's tokens, but behind a different first block: no hit."""
    start = post(lab_client, "reset", {"scenario": "chain"})
    a, b = start["sequences"]
    assert a["token_ids"][BS : 3 * BS] == b["token_ids"][BS : 3 * BS]
    assert start["lesson"]["question"]["hashed"] == 3
    _, frames = graded(lab_client, "chain", "8", "0", ["plan"])
    assert stage(frames, "plan")["sequences"][1]["num_cached_tokens"] == 0


def test_a_shared_prefix_is_taken_with_its_ref_count(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "reuse", "1", "2", ["plan"])
    plan = stage(frames, "plan")
    a, b = plan["sequences"]
    assert b["block_table"][:3] == a["block_table"][:3]
    assert [plan["blocks"][i]["ref_count"] for i in a["block_table"][:3]] == [2, 2, 2]
    assert b["num_cached_tokens"] == 3 * BS  # cached grew at plan time
    assert said(lesson, "reuse_held")["holders"] == "0, 1"


def test_a_partial_last_block_is_never_shared(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "partial", str(2 * BS + 2), str(2 * BS), ["plan"])
    a, b = stage(frames, "plan")["sequences"]
    assert a["token_ids"][: 2 * BS + 2] == b["token_ids"]
    assert b["block_table"][:2] == a["block_table"][:2]
    assert b["block_table"][2] != a["block_table"][2]
    assert b["num_scheduled_tokens"] == 2
    assert said(lesson, "cached_took")["shared"] == ", ".join(map(str, a["block_table"][:2]))


def test_freed_hashed_blocks_stay_cached(lab_client: TestClient) -> None:
    start = post(lab_client, "reset", {"scenario": "lru"})
    a = start["sequences"][0]
    assert a["status"] == "FINISHED"
    cached_free = [b["block_id"] for b in start["blocks"] if b["free"] and b["hash"]]
    assert len(cached_free) == 2
    _, frames = graded(lab_client, "lru", "0", str(2 * BS), ["plan"])
    b = stage(frames, "plan")["sequences"][2]
    assert sorted(b["block_table"][:2]) == sorted(cached_free)


# ---- 06 · ModelRunner --------------------------------------------------------------------------


def test_a_tokens_slot_comes_from_its_block_table(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "slot", "6", "14", ["plan", "commit"])
    inputs = stage(frames, "execute")["step_inputs"]
    assert inputs["query_lens"] == [1, 7] and inputs["positions"] == [5, *range(7)]
    b = stage(frames, "plan")["sequences"][1]
    pos = 6
    expected = b["block_table"][pos // BS] * BS + pos % BS
    assert inputs["slot_mapping"][1 + pos] == expected == 14
    assert said(lesson, "slot_row") == {"row": 7, "rows": 8, "step": 2}
    assert lesson["result"]["inputs"] == inputs  # the table the verdict shows is its step's


def test_a_decode_reads_every_slot_of_its_context(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "read", "1", "6", ["step"])
    inputs = stage(frames, "execute")["step_inputs"]
    a = stage(frames, "plan")["sequences"][0]
    assert inputs["seq_lens"][0] == 6 and inputs["query_lens"][0] == 1
    assert inputs["read_slots"][0] == [a["block_table"][p // BS] * BS + p % BS for p in range(6)]
    assert said(lesson, "read_slots")["slots"] == "0, 1, 2, 3, 4, 5"


def test_a_chunk_that_does_not_end_the_prompt_samples_nothing(lab_client: TestClient) -> None:
    lesson, frames = graded(lab_client, "logits", "2", "1", ["step"])
    inputs = stage(frames, "execute")["step_inputs"]
    assert inputs["query_lens"] == [1, 7] and inputs["sample_seq_ids"] == [0]
    assert inputs["logits_indices"] == [0]
    commit = stage(frames, "commit")
    assert [s["num_tokens"] for s in commit["sequences"]] == [5, 12]  # only A grew


# ---- 07 · Speculative decoding ----------------------------------------------------------------


def test_a_speculative_step_commits_accepted_plus_one(lab_client: TestClient) -> None:
    """The first plan with drafts schedules k + 1 tokens, the runner writes k + 1 slots, and
    only the commit advances cached, by accepted + 1; the chapter's draft source swaps the
    last draft, so one is rejected and its slot stays written, uncommitted, until the next
    step writes over it."""
    lesson, frames = graded(lab_client, "spec", "4", "3", ["step"] * 8)
    plan = next(
        f for f in frames if f["frame"]["stage"] == "plan" and f["sequences"][0]["spec_token_ids"]
    )
    after = frames[frames.index(plan) + 1 :]
    execute, commit = stage(after, "execute"), stage(after, "commit")
    a = plan["sequences"][0]
    assert a["num_scheduled_tokens"] == 1 + len(a["spec_token_ids"]) == 4
    assert execute["step_inputs"]["query_lens"] == [4]
    assert execute["sequences"][0]["num_cached_tokens"] == a["num_cached_tokens"]  # not yet
    assert commit["sequences"][0]["num_cached_tokens"] == a["num_cached_tokens"] + 3
    verdict = said(lesson, "spec_verdict")
    assert (verdict["accepted"], verdict["rejected"], verdict["appended"]) == (2, 1, 3)
    slots = execute["step_inputs"]["slot_mapping"]
    assert said(lesson, "spec_rejected") == {"rejected": 1, "slots": str(slots[3])}
    # The pool shows it: after the commit the slot still holds the rejected draft's KV.
    bs = commit["block_size"]
    slot = commit["blocks"][slots[3] // bs]["slots"][slots[3] % bs]
    assert slot["state"] == "written"
    assert slot["owners"][0]["draft"] and slot["owners"][0]["token_id"] == a["spec_token_ids"][2]
    # The next step's execute writes over the rejected draft's slot.
    later = [f for f in frames[frames.index(execute) + 1 :] if f["frame"]["stage"] == "execute"]
    assert any(slots[3] in f["step_inputs"]["slot_mapping"] for f in later)


# ---- refusals -------------------------------------------------------------------------------


def test_bad_predictions_and_options_are_refused_without_change(lab_client: TestClient) -> None:
    post(lab_client, "reset", {"scenario": "budget"})
    before = lab_client.get("/api/lab/state").json()
    assert post(lab_client, "predict", {"answer": "six"}, status=400)["code"] == "bad_number"
    assert post(lab_client, "predict", {"answer": "-1"}, status=400)["code"] == "bad_number"
    assert post(lab_client, "predict", {}, status=400)["code"] == "bad_request"
    post(lab_client, "reset", {"scenario": "victim"})
    assert post(lab_client, "predict", {"answer": "7"}, status=400)["code"] == "bad_choice"
    post(lab_client, "reset", {"scenario": "budget"})
    assert lab_client.get("/api/lab/state").json()["lesson"] == before["lesson"]
    post(lab_client, "plan")
    assert post(lab_client, "predict", {"answer": "6"}, status=409)["code"] == "too_late"
    post(lab_client, "reset", {"scenario": "seq8"})
    assert post(lab_client, "predict", {"answer": "1"}, status=409)["code"] == "no_lesson"
    for option, value in [
        ("num_kv_blocks", 0),
        ("num_kv_blocks", 65),
        ("max_num_batched_tokens", 1000),
        ("max_num_seqs", 0),
    ]:
        r = post(lab_client, "reset", {"scenario": "budget", option: value}, status=400)
        assert r["code"] == "option_range" and r["params"]["name"] == option
    # Too few blocks for the scenario's own requests: refused, the old experiment stays.
    r = post(lab_client, "reset", {"scenario": "victim", "num_kv_blocks": 1}, status=400)
    assert r["code"] == "setup_refused"
    assert lab_client.get("/api/lab/state").json()["scenario"] == "seq8"


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if s.chapter != "03"])
def test_every_lesson_scenario_runs_to_the_end(lab_client: TestClient, name: str) -> None:
    """Play: each scenario's requests all finish, and the answer never changes afterwards."""
    post(lab_client, "reset", {"scenario": name})
    answers = []
    for _ in range(40):
        state = post(lab_client, "step")
        if state["lesson"]["result"] is not None:
            answers.append(state["lesson"]["result"]["answer"])
        if all(s["status"] == "FINISHED" for s in state["sequences"]):
            break
    assert all(s["status"] == "FINISHED" for s in state["sequences"])
    assert answers and len(set(answers)) == 1


@pytest.mark.default_model
def test_lessons_on_the_default_model_answer_as_on_the_fake_runner(lab_client: TestClient) -> None:
    """On SmolLM2-135M every lesson gets the answer the fake runner's engine got: the prompts
    have exact lengths, so the scheduler, the block manager and the runner's inputs agree; the
    runner's inputs come from the real ModelRunner's run."""
    from minivllm.lab.engines import default_engines

    real = TestClient(create_app(default_engines(None, BS)))
    for name, scenario in SCENARIOS.items():
        if scenario.lesson is None:
            continue
        answers = []
        for client in (lab_client, real):
            post(client, "reset", {"scenario": name})
            result = None
            for _ in range(4):
                result = result or post(client, "step")["lesson"]["result"]
            answers.append(result)
        fake, model = answers
        assert model is not None, name
        if not scenario.lesson.depends_on_model:  # how many drafts a model accepts is its own
            assert model["answer"] == fake["answer"], name
    assert post(real, "reset", {"scenario": "slot"})["model"]["runner"] == "ModelRunner"
