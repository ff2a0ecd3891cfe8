"""docs/options.md is generated from `EngineConfig`'s fields (scripts/gen_options_doc.py):
this fails when an option is added, renamed or re-described without regenerating the page."""

from __future__ import annotations

import importlib.util
from dataclasses import fields
from pathlib import Path

from minivllm.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_options_doc", ROOT / "scripts" / "gen_options_doc.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_options_doc_matches_engine_config() -> None:
    doc = (ROOT / "docs" / "options.md").read_text()
    assert doc == _generator().render(), "docs/options.md is stale: run `make docs-options`"


def test_every_option_has_help_text_and_a_row() -> None:
    rendered = _generator().render()
    for f in fields(EngineConfig):
        assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"
        assert f"| `{f.name}` |" in rendered, f"{f.name} missing from docs/options.md"
