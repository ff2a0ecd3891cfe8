"""`minivllm bench` end to end on a tiny random checkpoint: every offline benchmark runs,
writes its JSON report, and the shared workloads are reproducible (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm.bench.workloads import Workload, shared_prefix_prompts
from minivllm.cli import main


def test_workload_is_the_same_for_the_same_seed_and_within_its_ranges():
    """Every benchmark and every peer it compares with must see the same prompts."""
    a = Workload(5, (3, 9), (2, 4), seed=7).make(1000)
    assert a == Workload(5, (3, 9), (2, 4), seed=7).make(1000)
    assert a != Workload(5, (3, 9), (2, 4), seed=8).make(1000)
    prompts, outs = a
    assert all(3 <= len(p) <= 9 and all(100 <= t < 900 for t in p) for p in prompts)
    assert all(2 <= n <= 4 for n in outs)
    shared = shared_prefix_prompts(4, 6, 2, 1000, seed=1)
    assert {tuple(p[:6]) for p in shared} == {tuple(shared[0][:6])}
    assert len({tuple(p) for p in shared}) == 4


@pytest.mark.parametrize("which", ["throughput", "prefix", "overhead"])
def test_offline_benchmarks_write_their_report(which: str, tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / f"{which}.json"
    rc = main(
        [
            "bench",
            which,
            "--model",
            str(tiny_llama_dir),
            "--num-requests",
            "3",
            "--input-min",
            "4",
            "--input-max",
            "12",
            "--output-min",
            "2",
            "--output-max",
            "5",
            "--prefix-len",
            "16",
            "--suffix-len",
            "4",
            "--output-len",
            "3",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == which
    assert all(r["tok_per_s"] > 0 for r in report["results"])


def test_the_llama_cpp_comparison_starts_each_server_as_asked(tmp_path: Path):
    """Our server gets the engine options as flags (the off switch's JSON included), and
    llama-server its --spec-type only when one is asked for (its default has no drafts)."""
    from minivllm.bench.peer import peer_commands
    from minivllm.config import SPECULATION_OFF

    gguf, server = tmp_path / "m.gguf", tmp_path / "llama-server"
    plain = peer_commands(gguf, server, {"speculative_config": SPECULATION_OFF}, (1, 2))
    assert plain["minivllm"][-2:] == ["--speculative-config", SPECULATION_OFF]
    assert "--spec-type" not in plain["llama.cpp"]
    drafts = peer_commands(gguf, server, {}, (1, 2), llama_spec_type="ngram-simple")
    assert drafts["llama.cpp"][-2:] == ["--spec-type", "ngram-simple"]


def test_the_edit_workload_asks_for_a_rename_of_a_method_the_file_has(tmp_path: Path):
    """Each edit request holds the whole file and names one of its methods; the comparison
    runs it at one stream, 400 tokens a request, with llama-server's slots long enough for
    the file and the answer."""
    from minivllm.bench.peer import level_plan, peer_commands
    from minivllm.bench.text_workloads import EDIT_FILE, EDIT_RENAMES, text_requests

    requests = text_requests("edit", 6, seed=3)
    assert requests == text_requests("edit", 6, seed=3)
    assert len(set(requests[:5])) == 5  # no prompt again before every rename has come
    for request in requests:
        assert EDIT_FILE in request
        old, new = next((o, n) for o, n in EDIT_RENAMES if f"`{o}` to `{n}`" in request)
        assert f"def {old}(" in EDIT_FILE and new not in EDIT_FILE
    assert [level[1] for level in level_plan("edit").levels] == [1]
    command = peer_commands(tmp_path / "m.gguf", tmp_path / "s", {}, (1, 2), workload="edit")
    assert command["llama.cpp"][command["llama.cpp"].index("-c") + 1] == "2048"


def test_the_long_workload_decodes_after_long_random_prompts(tmp_path: Path):
    """The long plan: one stream over prompts of 2k and 8k random ids (two each, each level its
    own), llama-server's one slot long enough for the longest and its answer; without
    --compare it says where its lengths go instead."""
    from minivllm.bench.peer import level_plan, level_prompts, peer_commands

    plan = level_plan("long")
    assert [(level[1], level[2]) for level in plan.levels] == [(1, 2), (1, 2)]
    prompts = level_prompts("long", None, seed=0)
    assert [[len(p) for p in level] for level in prompts] == [[2000, 2000], [8000, 8000]]
    assert prompts[1][0] != prompts[1][1] and prompts[1][0][:2000] != prompts[0][0]
    command = peer_commands(tmp_path / "m.gguf", tmp_path / "s", {}, (1, 2), workload="long")
    slot = int(command["llama.cpp"][command["llama.cpp"].index("-c") + 1])
    assert command["llama.cpp"][command["llama.cpp"].index("-np") + 1] == "1"
    assert slot >= 8000 + plan.output_tokens
    with pytest.raises(SystemExit, match="--input-min / --input-max"):
        main(["bench", "serve", "--workload", "long", "--url", "http://127.0.0.1:9"])


def test_the_comparison_gives_each_level_its_rate_and_decode_ratios(capsys):
    """Against llama.cpp each level of ours gets the ratio of output tokens a second, of the
    time between tokens (theirs over ours) and, with drafts, against our run without."""
    from minivllm.bench.peer import print_ratios

    def level(name: str, tok_per_s: float, itl: float) -> dict:
        times = {"itl_p50_s": itl, "itl_p99_s": itl, "ttft_p50_s": 0.1}
        return {"name": name, "tok_per_s": tok_per_s, **times}

    runs = {
        "minivllm": [level("c=1", 30.0, 0.02)],
        "minivllm, no speculation": [level("c=1", 15.0, 0.05)],
        "llama.cpp": [level("c=1", 12.0, 0.06)],
    }
    rows = print_ratios(runs)
    assert [row["server"] for row in rows] == ["minivllm", "minivllm, no speculation"]
    assert rows[0]["ratio"] == pytest.approx(2.5) and rows[0]["itl_ratio"] == pytest.approx(3.0)
    assert rows[0]["ratio_vs_no_speculation"] == pytest.approx(2.0)
    assert rows[1]["itl_ratio"] == pytest.approx(1.2) and "ratio_vs_no_speculation" not in rows[1]
    assert "(ITL p50 3.00x), 2.00x no speculation" in capsys.readouterr().out


def test_the_serve_benchmark_without_a_server_says_so(tmp_path: Path):
    """Pointed at a port where nothing listens, `bench serve` ends with one line naming the
    address and the two ways on, not an HTTP client's traceback."""
    import socket

    with socket.socket() as probe:  # a free port, then closed: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(SystemExit, match=f"no server answers at {url}.*--compare llama.cpp"):
        main(["bench", "serve", "--url", url, "--output", str(tmp_path / "serve.json")])


def test_rounds_take_turns_and_keep_each_rounds_ratio(monkeypatch, capsys):
    """With rounds, each level runs once a round on every server, the first server of a round
    the next one each time; a level's figures are the medians over its rounds, and the ratios
    printed pair each round of ours with the same round of llama.cpp's."""
    from minivllm.bench import peer

    calls, seen = [], []
    speeds = {"minivllm": [30.0, 10.0, 20.0], "llama.cpp": [20.0, 20.0, 40.0]}

    def fake_level(url, prompts, workload, index):
        name = url.removeprefix("http://")
        calls.append((name, index))
        seen.append(prompts[0][0][0])
        rate = speeds[name][sum(1 for n, i in calls if n == name and i == index) - 1]
        itl = 1 / rate
        return {
            "name": f"c{index}",
            "tok_per_s": rate,
            "itl_p50_s": itl,
            "itl_p99_s": itl,
            "ttft_p50_s": 0.1,
        }

    monkeypatch.setattr(peer, "load_level", fake_level)
    urls = {"minivllm": "http://minivllm", "llama.cpp": "http://llama.cpp"}
    runs = peer.taking_turns(urls, [[[[r]], [[r + 10]]] for r in range(3)], "random")
    assert calls[:4] == [("minivllm", 0), ("llama.cpp", 0), ("minivllm", 1), ("llama.cpp", 1)]
    assert calls[4:6] == [("llama.cpp", 0), ("minivllm", 0)]  # round 2 starts with the other
    assert seen == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]  # each round its own prompts
    assert runs["minivllm"][0]["tok_per_s"] == runs["llama.cpp"][0]["tok_per_s"] == 20.0
    rows = peer.print_ratios(runs)
    assert rows[0]["round_ratios"] == [1.5, 0.5, 0.5]
    assert rows[0]["ratio"] == 1.0
    assert "rounds 1.50x 0.50x 0.50x" in capsys.readouterr().out
