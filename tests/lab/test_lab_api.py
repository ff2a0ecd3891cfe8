"""The Engine Lab's JSON API: every scenario's exact field sequence, the frames time travel
walks through, the traced events with their real source lines, and refusals that never
break the lab's state. All on the fake runner except the last tests (the default model)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.fake_lab import fake_lab_engine
from support.fake_runner import FakeModelRunner

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.lab.app import create_app
from minivllm.lab.chapters import SCENARIOS
from minivllm.lab.scenarios import SEQ8_TEXT

ROOT = Path(__file__).resolve().parents[2]
SEQ_KEYS = {
    "seq_id",
    "status",
    "num_tokens",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_scheduled_tokens",
    "block_table",
    "token_ids",
    "text",
}
STATE_KEYS = {
    "sequences",
    "waiting",
    "running",
    "block_size",
    "num_blocks",
    "blocks",
    "pending_plan",
    "budget",
    "events",
}
EVENT_KEYS = {"step", "phase", "actor", "seq_id", "field", "before", "after", "source"}


fake_factory = fake_lab_engine


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(fake_factory))


def post(client: TestClient, path: str, body: object = None, status: int = 200) -> dict:
    r = client.post(f"/api/lab/{path}", json=body)
    assert r.status_code == status, r.text
    return r.json()


def seq(state: dict, seq_id: int | None = None) -> dict:
    wanted = state["focus_seq_id"] if seq_id is None else seq_id
    return next(s for s in state["sequences"] if s["seq_id"] == wanted)


def fields(s: dict) -> tuple:
    return (s["status"], s["num_scheduled_tokens"], s["num_cached_tokens"], s["num_tokens"])


def new_events(before: dict, after: dict) -> list[dict]:
    return after["events"][len(before["events"]) :]


def source_line(location: str) -> str:
    file, line = location.rsplit(":", 1)
    return (ROOT / file).read_text().splitlines()[int(line) - 1]


def test_seq8_follows_the_seed(client: TestClient) -> None:
    """The chapter's table: after Plan RUNNING, scheduled 8, cached 0, num_tokens 8; after Commit
    scheduled 0, cached 8, num_tokens 9; after Decode (Step) cached 9, num_tokens 10. An
    earlier request finished first, so the blocks are not 0, 1, ... and slot != position."""
    s0 = post(client, "reset", {"scenario": "seq8"})
    assert STATE_KEYS <= s0.keys() and SEQ_KEYS <= seq(s0).keys()
    assert fields(seq(s0)) == ("WAITING", 0, 0, 8) and s0["focus_seq_id"] == 1
    assert seq(s0)["num_prompt_tokens"] == 8 and seq(s0)["block_table"] == []
    assert s0["block_size"] == 4 and s0["num_blocks"] == 16 and not s0["pending_plan"]
    assert seq(s0, 0)["status"] == "FINISHED" and s0["num_free_blocks"] == 16
    assert [b["hash"] is not None for b in s0["blocks"][:3]] == [True, True, False]

    s1 = post(client, "plan")
    assert fields(seq(s1)) == ("RUNNING", 8, 0, 8)
    assert seq(s1)["block_table"] == [2, 3]
    assert s1["pending_plan"] and s1["budget"] == {
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "planned_tokens": 8,
    }
    assert [f["frame"]["stage"] for f in s1["frames"]] == ["plan"]
    assert {e["phase"] for e in new_events(s0, s1)} == {"plan"}

    s2 = post(client, "commit")
    assert fields(seq(s2)) == ("RUNNING", 0, 8, 9)
    assert not s2["pending_plan"] and s2["budget"]["planned_tokens"] == 0
    execute, commit = s2["frames"]
    assert (execute["frame"]["stage"], commit["frame"]["stage"]) == ("execute", "commit")
    # Between execute and commit: the KV is written, the token sampled, nothing committed.
    assert fields(seq(execute)) == ("RUNNING", 8, 0, 8)
    assert seq(execute)["sampled_token"] == seq(s2)["token_ids"][8]
    slots = [s["state"] for b in execute["blocks"][2:4] for s in b["slots"]]
    assert slots == ["written"] * 8
    assert [s["state"] for b in s2["blocks"][2:4] for s in b["slots"]] == ["committed"] * 8
    assert s2["blocks"][2]["slots"][0]["owners"] == [
        {"seq_id": 1, "pos": 0, "token_id": seq(s2)["token_ids"][0]}
    ]

    s3 = post(client, "step")
    assert fields(seq(s3)) == ("RUNNING", 0, 9, 10)
    assert [f["frame"]["stage"] for f in s3["frames"]] == ["plan", "execute", "commit"]
    assert fields(seq(s3["frames"][0])) == ("RUNNING", 1, 8, 9)
    assert seq(s3)["block_table"] == [2, 3, 4]


def test_events_come_from_the_tracer_with_real_source_lines(client: TestClient) -> None:
    """Each event names the phase, the function and a source line that really writes the
    field (read back from the file), not a location the lab made up."""
    s0 = post(client, "reset", {"scenario": "seq8"})
    s1 = post(client, "plan")
    s2 = post(client, "commit")
    assert s2["code"]["Sequence.__init__"].startswith("minivllm/engine/sequence.py:")
    assert "def __init__" in source_line(s2["code"]["Sequence.__init__"])
    plan = new_events(s0, s1)
    assert {(e["actor"], e["field"]) for e in plan} == {
        ("Scheduler.schedule", "status"),
        ("BlockManager.allocate", "block_table"),
        ("Scheduler.schedule", "num_scheduled_tokens"),
    }
    commit = new_events(s1, s2)
    assert [e["phase"] for e in commit] == ["execute"] * 2 + ["commit"] * 3
    assert [e["field"] for e in commit if e["phase"] == "execute"] == [
        "kv_written",
        "sampled_token",
    ]
    by_field = {e["field"]: e for e in commit if e["phase"] == "commit"}
    assert by_field["num_cached_tokens"]["actor"] == "Scheduler.postprocess"
    assert (by_field["num_cached_tokens"]["before"], by_field["num_cached_tokens"]["after"]) == (
        0,
        8,
    )
    assert by_field["num_tokens"]["actor"] == "Sequence.append_token"
    for e in plan + commit:
        assert EVENT_KEYS <= e.keys() and e["step"] == 3  # the earlier request ran 2
        if e["phase"] in ("plan", "commit"):
            assert re.fullmatch(r"minivllm/engine/\w+\.py:\d+", e["source"]), e
            line = source_line(e["source"])
            assert e["field"] in line or "block_table" in line or "append" in line, (e, line)

    src = client.get(
        "/api/lab/source", params={"location": by_field["num_cached_tokens"]["source"]}
    )
    assert src.status_code == 200
    body = src.json()
    assert body["function"] == "Scheduler.postprocess"
    assert "num_cached_tokens" in body["lines"][body["line"] - body["start"]]


def test_chunked_prefill_grows_cached_chunk_by_chunk(client: TestClient) -> None:
    """A 20-token prompt, budget 8: RUNNING throughout, cached 0 -> 8 -> 16 -> 20; the first
    token is sampled only with the last chunk."""
    post(client, "reset", {"scenario": "chunked"})
    seen = []
    for _ in range(3):
        planned = seq(post(client, "plan"))
        committed = seq(post(client, "commit"))
        seen.append((planned["num_scheduled_tokens"], fields(committed)))
    assert seen == [
        (8, ("RUNNING", 0, 8, 20)),
        (8, ("RUNNING", 0, 16, 20)),
        (4, ("RUNNING", 0, 20, 21)),
    ]
    assert fields(seq(post(client, "step"))) == ("RUNNING", 0, 21, 22)


def test_prefix_hit_moves_cached_at_plan_time(client: TestClient) -> None:
    """seq 1 shares seq 0's first three (committed, hashed) blocks: right after Plan its
    cached is 12, set by BlockManager.take_prefix in the plan phase, the blocks shared."""
    s0 = post(client, "reset", {"scenario": "prefix"})
    a, b = seq(s0, 0), seq(s0, 1)
    assert s0["focus_seq_id"] == 1
    assert fields(a) == ("RUNNING", 0, 14, 15) and fields(b) == ("WAITING", 0, 0, 15)
    assert a["token_ids"][:12] == b["token_ids"][:12]
    assert all(blk["hash"] is not None for blk in s0["blocks"][:3])

    s1 = post(client, "plan")
    b = seq(s1, 1)
    assert fields(b) == ("RUNNING", 3, 12, 15)
    assert b["block_table"][:3] == seq(s1, 0)["block_table"][:3]
    for block_id in b["block_table"][:3]:
        assert s1["blocks"][block_id]["ref_count"] == 2
        assert s1["blocks"][block_id]["seq_ids"] == [0, 1]
    hit = [e for e in new_events(s0, s1) if e["seq_id"] == 1 and e["field"] == "num_cached_tokens"]
    assert [(e["phase"], e["actor"], e["before"], e["after"]) for e in hit] == [
        ("plan", "BlockManager.take_prefix", 0, 12)
    ]
    assert s1["budget"]["planned_tokens"] == 1 + 3  # seq 0's decode and seq 1's tail

    assert fields(seq(post(client, "commit"), 1)) == ("RUNNING", 0, 15, 16)


def test_preemption_sends_a_running_sequence_back_to_waiting(client: TestClient) -> None:
    """A 4-block pool held by two sequences: seq 0's decode needs a fifth block, so seq 1 is
    preempted: WAITING, blocks freed, cached reset, its tokens kept."""
    s0 = post(client, "reset", {"scenario": "preempt"})
    assert s0["num_blocks"] == 4 and s0["num_free_blocks"] == 0
    assert fields(seq(s0, 0)) == fields(seq(s0, 1)) == ("RUNNING", 0, 8, 9)

    s1 = post(client, "plan")
    b = seq(s1, 1)
    assert fields(b) == ("WAITING", 0, 0, 9) and b["block_table"] == []
    assert b["num_preemptions"] == 1
    assert fields(seq(s1, 0)) == ("RUNNING", 1, 8, 9) and len(seq(s1, 0)["block_table"]) == 3
    assert s1["waiting"] == [1] and s1["running"] == [0]
    status = [e for e in new_events(s0, s1) if e["seq_id"] == 1 and e["field"] == "status"]
    assert [(e["phase"], e["actor"], e["before"], e["after"]) for e in status] == [
        ("plan", "Scheduler._preempt", "RUNNING", "WAITING")
    ]

    state = post(client, "commit")
    readmitted = None
    for _ in range(10):
        if seq(state, 1)["status"] == "FINISHED":
            break
        state = post(client, "step")
        if readmitted is None and seq(state, 1)["status"] == "RUNNING":
            readmitted = seq(state["frames"][0], 1)  # its plan frame
    assert seq(state, 0)["status"] == seq(state, 1)["status"] == "FINISHED"
    assert readmitted is not None and readmitted["num_tokens"] == 9
    assert state["num_free_blocks"] == 4


def test_finish_returns_the_blocks(client: TestClient) -> None:
    """max_tokens=2: Plan, Commit, Decode -> FINISHED ("length"), block table empty, every
    ref count 0; the full block keeps its hash (still in the prefix cache)."""
    post(client, "reset", {"scenario": "finish"})
    assert fields(seq(post(client, "plan"))) == ("RUNNING", 6, 0, 6)
    assert fields(seq(post(client, "commit"))) == ("RUNNING", 0, 6, 7)
    s = post(client, "step")
    assert fields(seq(s)) == ("FINISHED", 0, 7, 8)
    assert seq(s)["finish_reason"] == "length" and seq(s)["block_table"] == []
    assert s["num_free_blocks"] == 16 and all(b["ref_count"] == 0 for b in s["blocks"])
    assert s["blocks"][0]["hash"] is not None
    assert [x["state"] for x in s["blocks"][0]["slots"]] == ["cached"] * 4
    assert post(client, "step", status=409)["code"] == "all_finished"
    assert post(client, "plan", status=409)["code"] == "all_finished"


def test_refusals_never_break_the_state(client: TestClient) -> None:
    """Out-of-order clicks (409), unknown scenarios, bad JSON and bad fields (400) answer
    {"error": ...} and leave the state exactly as it was."""
    post(client, "reset", {"scenario": "seq8"})
    before = client.get("/api/lab/state").json()
    assert post(client, "commit", status=409)["code"] == "no_plan"
    unknown = post(client, "reset", {"scenario": "nope"}, status=400)
    assert unknown["code"] == "unknown_scenario" and unknown["params"]["name"] == "nope"
    r = client.post(
        "/api/lab/reset", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    assert "error" in post(client, "reset", {"scenario": 3}, status=400)
    # Empty and whitespace-only get the same answer; each refusal has a code to translate.
    assert post(client, "add", {"prompt": ""}, status=400)["code"] == "prompt_empty"
    assert post(client, "add", {"prompt": " \n "}, status=400)["code"] == "prompt_empty"
    assert post(client, "add", {"prompt": "hi", "max_tokens": 0}, status=400)["code"] == (
        "max_tokens_range"
    )
    assert post(client, "add", {"prompt": "x" * 2001}, status=400)["code"] == "prompt_too_long"
    assert post(client, "add", {"prompt": 3}, status=400)["code"] == "bad_request"
    assert post(client, "add", {"prompt": "hi"}, status=400)["code"] == "no_tokenizer"
    assert client.get("/api/lab/state").json() == before

    planned = post(client, "plan")
    assert post(client, "plan", status=409)["code"] == "plan_pending"
    assert post(client, "step", status=409)["code"] == "step_pending"
    after = client.get("/api/lab/state").json()
    assert after == {k: v for k, v in planned.items() if k != "frames"}
    assert fields(seq(post(client, "commit"))) == ("RUNNING", 0, 8, 9)

    assert (
        client.get("/api/lab/source", params={"location": "../../etc/passwd:1"}).status_code == 404
    )
    assert client.get("/api/lab/source", params={"location": "nonsense"}).status_code == 404
    assert client.get("/api/lab/nothing").json()["code"] == "not_found"


def test_frames_are_snapshots_for_time_travel(client: TestClient) -> None:
    """The history holds one frame per phase boundary, numbered in order; a frame keeps the
    values of its moment after the engine moves on."""
    post(client, "reset", {"scenario": "seq8"})
    post(client, "plan")
    post(client, "commit")
    post(client, "step")
    frames = client.get("/api/lab/history").json()["frames"]
    assert [f["frame"]["index"] for f in frames] == list(range(len(frames)))
    assert [f["frame"]["action"] for f in frames[:7]] == ["setup"] * 7  # the earlier request
    frames = frames[7:]
    assert [(f["frame"]["action"], f["frame"]["stage"]) for f in frames] == [
        ("setup", "add"),
        ("plan", "plan"),
        ("commit", "execute"),
        ("commit", "commit"),
        ("step", "plan"),
        ("step", "execute"),
        ("step", "commit"),
    ]
    assert [seq(f)["num_cached_tokens"] for f in frames] == [0, 0, 0, 8, 8, 8, 9]
    assert [seq(f)["num_scheduled_tokens"] for f in frames] == [0, 8, 8, 0, 1, 1, 0]
    assert [len(f["events"]) for f in frames] == sorted(len(f["events"]) for f in frames)
    # A reset starts a new timeline.
    assert len(post(client, "reset", {"scenario": "finish"})["frames"]) == 1
    assert len(client.get("/api/lab/history").json()["frames"]) == 1


def test_concurrent_clicks_are_serialized(client: TestClient) -> None:
    """Plans and commits from many threads at once: each is answered 200 or 409, and the
    engine's invariants hold afterwards (one lock guards the engine)."""
    post(client, "reset", {"scenario": "chunked"})
    codes: list[int] = []

    def click(path: str) -> None:
        for _ in range(5):
            codes.append(client.post(f"/api/lab/{path}").status_code)

    threads = [threading.Thread(target=click, args=(p,)) for p in ["plan", "commit", "step"] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(codes) <= {200, 409} and 200 in codes
    lab = client.app.state.lab
    lab._experiment.engine.scheduler.check_invariants()
    frames = client.get("/api/lab/history").json()["frames"]
    assert [f["frame"]["index"] for f in frames] == list(range(len(frames)))


def test_page_and_its_hooks_are_served(client: TestClient) -> None:
    """The page, its script and styles come from the package; the data-testid hooks the
    issue lists are in the page or built by the script."""
    html = client.get("/").text
    modules = [
        "main",
        "core",
        "i18n",
        "words_en",
        "words_zh",
        "guides",
        "sequence",
        "pool",
        "log",
        "timeline",
    ]
    scripts = {m: client.get(f"/static/{m}.js") for m in modules}
    assert all(r.status_code == 200 for r in scripts.values())
    js = "".join(r.text for r in scripts.values())
    assert all(client.get(f"/static/{c}.css").status_code == 200 for c in ["lab", "state"])
    assert '<script type="module" src="/static/main.js">' in html
    # The tabs come from the server's list, not from a copy in the page.
    listed = client.get("/api/lab/scenarios").json()["scenarios"]
    assert [s["name"] for s in listed] == list(SCENARIOS)
    assert '"/api/lab/scenarios"' in scripts["main"].text
    for hook in [
        "btn-plan",
        "btn-commit",
        "btn-step",
        "btn-back",
        "btn-forward",
        "block-table",
        "event-log",
        "lang-toggle",
    ]:
        assert f'data-testid="{hook}"' in html, hook
    for hook in ["scenario-${name}", "predict-choice-${key}", "field-${field}"]:
        assert hook in js, hook
    chapter_03 = {name for name, s in SCENARIOS.items() if s.chapter == "03"}
    assert chapter_03 == {"seq8", "chunked", "prefix", "preempt", "finish"}


@pytest.mark.default_model
def test_seq8_on_the_default_model() -> None:
    """On SmolLM2-135M: the preset text is exactly 8 tokens, the chapter's field sequence holds,
    the execute events name ModelRunner.run in its own file, and a learner's text prompt runs."""
    from minivllm.lab.engines import default_engines

    client = TestClient(create_app(default_engines(None, 4)))
    s0 = post(client, "reset", {"scenario": "seq8"})
    assert seq(s0)["text"] == SEQ8_TEXT and seq(s0)["num_prompt_tokens"] == 8
    assert s0["model"]["runner"] == "ModelRunner" and s0["model"]["tokenizer"]
    assert fields(seq(post(client, "plan"))) == ("RUNNING", 8, 0, 8)
    s2 = post(client, "commit")
    assert fields(seq(s2)) == ("RUNNING", 0, 8, 9)
    execute = [e for e in s2["events"] if e["phase"] == "execute"]
    assert {e["actor"] for e in execute} == {"ModelRunner.run"}
    assert all(e["source"].startswith("minivllm/engine/model_runner.py:") for e in execute)
    assert seq(s2)["completion_text"] != ""
    assert fields(seq(post(client, "step"))) == ("RUNNING", 0, 9, 10)

    added = post(client, "add", {"prompt": "The capital of France is", "max_tokens": 2})
    mine = added["sequences"][-1]
    assert mine["status"] == "WAITING" and mine["text"] == "The capital of France is"
    s = post(client, "step")
    assert seq(s, mine["seq_id"])["num_cached_tokens"] == mine["num_prompt_tokens"]

    # A refused request uses no sequence id; a Chinese prompt's split characters show as bytes
    # on the first piece and whole on the last, never as U+FFFD.
    refused = post(client, "add", {"prompt": "word " * 40, "max_tokens": 64}, status=400)
    assert refused["code"] == "refused" and "KV blocks" in refused["params"]["detail"]
    zh = post(client, "add", {"prompt": "你好，世界", "max_tokens": 1})["sequences"][-1]
    assert zh["seq_id"] == mine["seq_id"] + 1
    assert zh["text"] == "你好，世界" and "\ufffd" not in "".join(zh["pieces"])
    assert zh["pieces"][:2] == ["<0xE4><0xBD>", "你"]

    s0 = post(client, "reset", {"scenario": "prefix"})
    assert fields(seq(post(client, "plan"))) == ("RUNNING", 3, 12, 15)


def test_snapshot_of_any_engine_without_a_tracer() -> None:
    """snapshot.py photographs a plain LLMEngine (a server's, with the null tracer): the
    queues, the sequences and the KV pool, no events; it changes nothing."""
    from minivllm.lab.snapshot import Snapshotter
    from minivllm.sampling_params import SamplingParams

    config = EngineConfig(
        block_size=4, num_kv_blocks=8, max_num_batched_tokens=64, max_model_len=64
    )
    engine = LLMEngine(config, FakeModelRunner(8, 4), None)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request(list(range(5, 11)), params)
    engine.step()
    engine.add_request(list(range(20, 23)), params)
    snap = Snapshotter(engine)
    state = snap.state()
    assert state["events"] == [] and state["waiting"] == [1] and state["running"] == [0]
    assert [s["seq_id"] for s in state["sequences"]] == [1, 0]  # waiting, then running
    running = state["sequences"][1]
    assert (running["num_cached_tokens"], running["num_tokens"]) == (6, 7)
    assert running["text"] is None and running["pieces"] is None
    held = [s for b in state["blocks"] for s in b["slots"] if s["owners"]]
    assert [s["state"] for s in held] == ["committed"] * 6 + ["reserved"] * 2
    assert state["code"]["Scheduler.postprocess"].startswith("minivllm/engine/scheduler.py:")
    assert snap.state() == state
