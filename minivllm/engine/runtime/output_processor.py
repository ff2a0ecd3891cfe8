"""OutputProcessor: the engine's token outputs turned into the API's RequestOutputs.

The engine (`LLMEngine.step`) commits token ids and nothing else (engine_output.py). This is
the one place that makes text of them, for the Python API (`LLM`) and the server's runtime
(`EngineLoop`, in-process or in the engine process) alike:
- detokenization: a request's text is its completion tokens decoded, refreshed whenever a
  step committed new ones (`skip_special_tokens` as the request asks);
- stop strings: the text is cut before the first one, and the request ends with "stop" at
  the token that completed it (`LLMEngine.stop_sequence`), tokens a speculative step appended
  after it dropped;
- logprobs: each new Logprob entry's `decoded_token`, and `cumulative_logprob`.

It runs on the thread that steps the engine, right after each step: a stop string ends its
sequence before the next plan, exactly where the engine would have stopped it itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from minivllm.engine.engine_output import EngineOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import Sequence
from minivllm.logprobs import TokenTexts
from minivllm.outputs import CompletionOutput, RequestOutput


@dataclass
class _State:
    """What one request's outputs have been turned into so far."""

    text: str = ""
    num_tokens: int = 0  # completion tokens the text was decoded from
    num_logprobs: int = 0  # completion Logprob entries whose decoded_token is filled
    num_prompt_logprobs: int = 0  # prompt Logprob entries likewise


class OutputProcessor:
    """Detokenizes, stops at stop strings and formats logprobs for one engine's requests."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer  # None: token ids only, no text
        self.token_texts = TokenTexts(engine.tokenizer)  # the decoded_token of Logprob entries
        self._states: dict[int, _State] = {}  # by the engine's seq_id

    def process(self, outputs: list[EngineOutput]) -> list[RequestOutput]:
        """The step's outputs with their text, stop strings applied; call once per step, before
        the engine plans the next one."""
        return [self._process(output) for output in outputs]

    def abort(self, seq_id: int) -> None:
        """Forget a request the engine aborted (no output of it follows)."""
        self._states.pop(seq_id, None)

    def _process(self, output: EngineOutput) -> RequestOutput:
        seq = output.seq
        assert seq is not None, "an EngineOutput always carries its sequence"
        state = self._states.setdefault(seq.seq_id, _State())
        completion = output.outputs[0]
        if self.tokenizer is not None and len(completion.token_ids) != state.num_tokens:
            state.num_tokens = len(completion.token_ids)
            num_kept = self._detokenize(state, seq, completion.token_ids)
            if num_kept is not None:
                self.engine.stop_sequence(seq, num_kept)
                completion = _cut_at_stop(completion, num_kept)
                output.finished = True
                if output.metrics is not None and output.metrics.finished_time is None:
                    output.metrics.finished_time = time.monotonic()
        self._decode_logprobs(state, output, completion)
        if output.finished:
            del self._states[seq.seq_id]
        result = output.request_output()
        result.outputs = [replace(completion, text=state.text)]
        if completion.logprobs is not None:
            result.outputs[0].cumulative_logprob = sum(
                entry[token].logprob
                for entry, token in zip(completion.logprobs, completion.token_ids)
            )
        return result

    def _detokenize(self, state: _State, seq: Sequence, token_ids: list[int]) -> int | None:
        """Refresh the text; at a stop string, cut the text there and return how many
        completion tokens to keep (None: no stop string)."""
        sp = seq.sampling_params
        previous = len(state.text)
        state.text = self.tokenizer.decode(token_ids, skip_special_tokens=sp.skip_special_tokens)
        if not sp.stop_strings:
            return None
        longest = max(map(len, sp.stop_strings))
        start = max(0, previous - longest)  # only the new text, and a stop it may complete
        hits = [(i, s) for s in sp.stop_strings if (i := state.text.find(s, start)) >= 0]
        if not hits:
            return None
        state.text = state.text[: min(hits)[0]]
        return self._tokens_to_stop(seq, token_ids, start)

    def _tokens_to_stop(self, seq: Sequence, token_ids: list[int], start: int) -> int:
        """The number of completion tokens up to the one that completed the stop string: a
        speculative step appends several tokens, and some may follow the stop."""
        sp = seq.sampling_params
        n = len(token_ids)
        while n > 1:
            text = self.tokenizer.decode(
                token_ids[: n - 1], skip_special_tokens=sp.skip_special_tokens
            )
            if not any(text.find(s, start) >= 0 for s in sp.stop_strings):
                break
            n -= 1
        return n

    def _decode_logprobs(
        self, state: _State, output: EngineOutput, completion: CompletionOutput
    ) -> None:
        """Fill the decoded_token of the Logprob entries committed since the last output."""
        if completion.logprobs is not None:
            self.token_texts.fill(completion.logprobs[state.num_logprobs :])
            state.num_logprobs = len(completion.logprobs)
        if output.prompt_logprobs is not None:  # [None, entry per prompt token after the first]
            self.token_texts.fill(output.prompt_logprobs[1 + state.num_prompt_logprobs :])
            state.num_prompt_logprobs = len(output.prompt_logprobs) - 1


def _cut_at_stop(completion: CompletionOutput, num_kept: int) -> CompletionOutput:
    """`completion` ended with "stop" after its first `num_kept` tokens."""
    logprobs = completion.logprobs
    return replace(
        completion,
        token_ids=completion.token_ids[:num_kept],
        finish_reason="stop",
        logprobs=None if logprobs is None else logprobs[:num_kept],
    )
