"""The start-up phases' lines (minivllm/startup.py): one as a phase begins, one with its time as
it ends, none claiming an end that did not come."""

from __future__ import annotations

import logging

import pytest

from minivllm.startup import phase, show_progress


def test_a_phase_says_when_it_begins_and_how_long_it_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="minivllm.startup"), phase("loading the weights"):
        assert [r.getMessage() for r in caplog.records] == ["loading the weights ..."]
    begun, ended = (r.getMessage() for r in caplog.records)
    assert begun == "loading the weights ..."
    assert ended.startswith("loading the weights: ") and ended.endswith(" s")
    float(ended.removeprefix("loading the weights: ").removesuffix(" s"))


def test_a_failed_phase_logs_no_end(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="minivllm.startup"):
        with pytest.raises(OSError), phase("building the kernels"):
            raise OSError("no compiler")
    assert [r.getMessage() for r in caplog.records] == ["building the kernels ..."]


def test_show_progress_shows_them_under_a_warning_root() -> None:
    root, startup = logging.getLogger(), logging.getLogger("minivllm.startup")
    levels = root.level, startup.level
    try:
        root.setLevel(logging.WARNING)  # the command line's level without --verbose
        startup.setLevel(logging.NOTSET)
        assert not startup.isEnabledFor(logging.INFO)
        show_progress()
        assert startup.isEnabledFor(logging.INFO)
    finally:
        root.setLevel(levels[0])
        startup.setLevel(levels[1])
