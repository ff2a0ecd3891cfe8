"""Speculation's timed start-up steps kept between starts (minivllm/engine/step_times_store.py):
a second start of the same model with the same options reads them instead of timing them, any
other option times them again, and a torn file is measured over."""

from __future__ import annotations

import json

import pytest

from minivllm import LLM
from minivllm.engine import spec_cost
from minivllm.engine.step_times_store import load_step_times, step_times_key


@pytest.fixture
def timed(tmp_path, monkeypatch) -> dict[str, int]:
    """A fresh cache, and how many times start-ups timed their steps."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    counts = {"steps": 0, "wide": 0}
    measure, wide = spec_cost.measure_step_times, spec_cost.with_wide_step

    def counted_measure(*args):
        counts["steps"] += 1
        return measure(*args)

    def counted_wide(*args):
        counts["wide"] += 1
        return wide(*args)

    monkeypatch.setattr(spec_cost, "measure_step_times", counted_measure)
    monkeypatch.setattr(spec_cost, "with_wide_step", counted_wide)
    return counts


def _start(model_dir, max_model_len: int = 256) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=max_model_len)


def _kept(tmp_path) -> list:
    return sorted((tmp_path / "step-times").glob("*.json"))


def test_a_second_start_reads_what_the_first_timed(
    tiny_llama_dir, tmp_path, timed, monkeypatch
) -> None:
    # The second start never finds the machine quieter (that path has a test of its own below):
    # a first start slowed by the suite's previous test would otherwise be timed again.
    monkeypatch.setattr(spec_cost, "QUIETER", 0.0)
    first = _start(tiny_llama_dir)
    spec = first.llm_engine.config.speculative_config
    assert spec is not None and spec.draft_token_cost is not None  # the tiny model's drafts pay
    assert timed == {"steps": 1, "wide": 1} and len(_kept(tmp_path)) == 1
    second = _start(tiny_llama_dir)
    assert timed == {"steps": 1, "wide": 1}  # nothing timed again
    assert second.llm_engine.config.speculative_config == spec
    (path,) = _kept(tmp_path)
    assert load_step_times(path.stem)["wide"] is not None  # the third step's, kept too


def test_another_option_or_a_torn_file_is_timed_again(tiny_llama_dir, tmp_path, timed) -> None:
    _start(tiny_llama_dir)
    _start(tiny_llama_dir, max_model_len=128)  # another option: its own file
    assert timed["steps"] == 2 and len(_kept(tmp_path)) == 2
    for path in _kept(tmp_path):
        path.write_text('{"plain": "fast"')
        assert load_step_times(path.stem) is None
    _start(tiny_llama_dir)
    assert timed["steps"] == 3
    assert sum(load_step_times(path.stem) is not None for path in _kept(tmp_path)) == 1


def test_fake_runners_and_draft_models_keep_nothing() -> None:
    assert step_times_key(object(), [4, 16]) is None
    assert load_step_times(None) is None


def test_times_kept_on_a_busier_machine_are_timed_again(tiny_llama_dir, tmp_path, timed) -> None:
    """Kept times whose one-token step is notably slower than one timed now came from a busier
    machine: timed again, and the new ones kept; kept times that are faster than now stand."""
    _start(tiny_llama_dir)
    (path,) = _kept(tmp_path)

    def scale_plain(factor: float) -> float:
        times = json.loads(path.read_text())
        path.write_text(json.dumps({**times, "plain": times["plain"] * factor}))
        return times["plain"] * factor

    # a thousandfold: a suite or a build beside this test can make one timed step ten times
    # slower, and the kept times then stood
    busy = scale_plain(1000.0)
    _start(tiny_llama_dir)
    assert timed["steps"] == 2
    assert load_step_times(path.stem)["plain"] < busy / 2  # the quieter start's, kept
    scale_plain(0.1)
    _start(tiny_llama_dir)
    assert timed["steps"] == 2
