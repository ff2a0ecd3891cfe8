"""The engine commits token ids only; the runtime's OutputProcessor makes their text, and
ends a request at a stop string before the engine plans another token for it."""

from __future__ import annotations

from support.engine_checks import assert_no_leaks
from support.fake_runner import FakeModelRunner, reference_completion

from minivllm.config import EngineConfig
from minivllm.engine.engine_output import EngineOutput
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.output_processor import OutputProcessor
from minivllm.sampling_params import SamplingParams

VOCAB, ORDER = 16, 1
PROMPT = [1, 2, 3]


class LetterTokenizer:
    """Token i is the letter 'a' + i."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class NoDecodeTokenizer:
    """A tokenizer the engine must never decode with."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise AssertionError("LLMEngine decoded tokens")


def _engine(tokenizer: object) -> LLMEngine:
    config = EngineConfig(block_size=4, max_model_len=64)
    return LLMEngine(config, FakeModelRunner(32, 4, VOCAB, ORDER), tokenizer)


def test_the_engines_step_output_carries_token_ids_only() -> None:
    """LLMEngine does no detokenizing and no stop-string trimming: with a tokenizer that fails
    to decode, every step output is an EngineOutput with token ids and no text, and a stop
    string its text would contain does not end the request."""
    want = reference_completion(PROMPT, 6, VOCAB, ORDER)
    stop = LetterTokenizer().decode(want[1:2])
    engine = _engine(NoDecodeTokenizer())
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, stop=[stop]))
    outputs: list[EngineOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs and all(isinstance(o, EngineOutput) for o in outputs)
    assert all(o.outputs[0].text == "" for o in outputs)
    assert outputs[-1].outputs[0].token_ids == want
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert_no_leaks(engine)


def test_a_stop_string_ends_the_request_before_the_next_plan() -> None:
    """The processor cuts the text before the stop string, keeps the tokens up to the one
    that completed it, and the engine frees the request's blocks at once."""
    want = reference_completion(PROMPT, 12, VOCAB, ORDER)
    text = LetterTokenizer().decode(want)
    stop = text[3:5]
    end = text.index(stop)
    engine = _engine(LetterTokenizer())
    processor = OutputProcessor(engine)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    while True:
        [out] = processor.process(engine.step())
        if out.finished:
            break
        assert stop not in out.outputs[0].text
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)
    assert out.outputs[0].text == text[:end]
    assert out.outputs[0].token_ids == want[: end + 2]
    assert out.outputs[0].finish_reason == "stop"
    assert type(out) is not EngineOutput  # what leaves the runtime is a plain RequestOutput
