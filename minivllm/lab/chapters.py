"""The lab's chapters, in order, each with its scenarios and the functions where its lesson
lives in our source ("where to read the code": `file:line` the code pane opens).

Pure Python: no torch here.
"""

from __future__ import annotations

from minivllm.engine.block_manager import BlockManager, hash_block
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence
from minivllm.engine.spec_decode import NgramProposer
from minivllm.engine.tracing import source_of
from minivllm.lab.ch04_scheduler import CHAPTER_04
from minivllm.lab.ch05_blocks import CHAPTER_05
from minivllm.lab.ch06_runner import CHAPTER_06
from minivllm.lab.ch07_speculation import CHAPTER_07
from minivllm.lab.scenarios import CHAPTER_03, Scenario

SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in [*CHAPTER_03, *CHAPTER_04, *CHAPTER_05, *CHAPTER_06, *CHAPTER_07]
}

# The runner's functions are named by file and line without importing the runner (torch).
RUNNER_FILE = "minivllm/engine/model_runner.py"


def _runner_code() -> list[str]:
    from minivllm.lab.source import function_line

    return [
        function_line(RUNNER_FILE, name)
        for name in ("slot_mapping_for", "prepare_inputs", "ModelRunner.run")
    ]


def chapters() -> list[dict[str, object]]:
    """[{chapter, code: [{function, location: "minivllm/...py:LINE"}, ...]}] in order."""
    code = {
        "03": [
            source_of(Sequence.__init__),
            source_of(Scheduler.schedule),
            source_of(Scheduler.postprocess),
        ],
        "04": [
            source_of(Scheduler.schedule),
            source_of(Scheduler._preempt),
            source_of(BlockManager.can_allocate),
        ],
        "05": [
            source_of(hash_block),
            source_of(BlockManager.match_prefix),
            source_of(BlockManager.take_prefix),
            source_of(BlockManager.free),
            source_of(BlockManager.commit),
        ],
        "06": _runner_code(),
        "07": [
            source_of(NgramProposer.propose),
            source_of(Scheduler._propose_all),
            source_of(Scheduler.postprocess),
        ],
    }
    return [
        {
            "chapter": name,
            "code": [{"function": _function_at(loc), "location": loc} for loc in locations],
        }
        for name, locations in code.items()
    ]


def _function_at(location: str) -> str:
    from minivllm.lab.source import function_source

    return str(function_source(location)["function"])
