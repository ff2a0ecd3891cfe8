"""EngineOutput: what `LLMEngine.step` hands out per request, token ids only.

The engine commits tokens; it never turns them into text. Its outputs are `RequestOutput`s
whose `text` is "" and whose Logprob entries have no `decoded_token` yet: the runtime's
`OutputProcessor` (engine/runtime/output_processor.py) detokenizes them, cuts stop strings and
formats the logprobs, and hands the API a plain `RequestOutput`. Code that needs only token
ids, finish reasons or logprob values (tests, benchmarks, the lab) may read an EngineOutput
as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from minivllm.engine.sequence import Sequence
from minivllm.outputs import RequestOutput


@dataclass
class EngineOutput(RequestOutput):
    """A request's state after a step as the engine committed it: cumulative token ids, the
    finish reason, raw logprobs (values and ranks), metrics, error, embedding; no text, no
    `cumulative_logprob`. `seq` is the engine's record of the request, read by the output
    processor (its sampling params) and handed back to `LLMEngine.stop_sequence`."""

    seq: Sequence | None = field(default=None, repr=False, compare=False)

    def request_output(self) -> RequestOutput:
        """The same fields as a plain RequestOutput (what leaves the engine's thread)."""
        names = [f.name for f in fields(RequestOutput)]
        return RequestOutput(**{name: getattr(self, name) for name in names})
