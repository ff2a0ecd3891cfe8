"""Reliability: runner faults under load, a bad-input matrix, determinism under batching.

- Faults (tests/support/faults.py wraps the model runner): a failed step commits nothing,
  its plan is dropped, its batch's requests end with finish_reason "error" (HTTP: an error
  event when streamed, a 500 JSON body when not), every other request produces exactly the greedy
  tokens it produces without the fault, and every KV block comes back.
- Bad input: one table of cases over the Python API and HTTP; each gets a clear error (HTTP:
  its status and OpenAI's error JSON) and the engine serves the next request.
- Determinism: a greedy request gives the same tokens alone and inside a busy batch with
  chunked prefill and preemption (fp32 on CPU).

The soak lives in test_reliability_soak.py, shutdown in test_reliability_shutdown.py.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.engine_checks import assert_no_leaks, run_to_completion
from support.fake_runner import reference_completion
from support.faults import INJECTED, FaultyRunner
from support.server_helpers import scrape_metrics, wait_idle

from minivllm import LLM
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import SequenceStatus
from minivllm.sampling_params import SamplingParams
from minivllm.server import ServerThread, create_app

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _base_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine.from_options(
        model=str(model_dir),
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=256,
        dtype="float32",
    )


def engine_on(base: LLMEngine, num_kv_blocks: int | None = None, **changes: Any) -> LLMEngine:
    """A fresh engine (empty queues, empty prefix cache) on `base`'s loaded model, behind a
    FaultyRunner that fails nothing until told to."""
    runner = FaultyRunner(base.model_runner, num_kv_blocks=num_kv_blocks)
    return LLMEngine(replace(base.config, **changes), runner, base.tokenizer)


def random_prompts(n: int, seed: int, vocab: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def generate_alone(base: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine = engine_on(base)
    engine.add_request(prompt, greedy(max_tokens))
    (out,) = run_to_completion(engine).values()
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def base(tiny_llama_dir: Path) -> LLMEngine:
    """The tiny Llama, loaded once; tests build engines over its runner one at a time."""
    return _base_engine(tiny_llama_dir)


# ---- faults: the engine ---------------------------------------------------------------------


def step_checking_faults(engine: LLMEngine) -> dict[str, Any]:
    """Step `engine` to idle. After every step that failed, check that the failed batch
    committed nothing and ended, and that its plan left nothing behind. Returns the finals."""
    runner: FaultyRunner = engine.model_runner  # type: ignore[assignment]
    finals: dict[str, Any] = {}
    for _ in range(20_000):
        if not engine.has_unfinished_requests():
            return finals
        seen = len(runner.failures)
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
        for failure in runner.failures[seen:]:
            by_id = {o.request_id: o for o in outputs}
            for seq in failure.seqs:
                assert seq.num_cached_tokens == failure.num_cached_tokens[seq.seq_id]
                assert seq.num_tokens == failure.num_tokens[seq.seq_id], "a sample committed"
                assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == "error"
                assert seq.block_table == [] and seq.num_scheduled_tokens == 0
                assert seq not in engine.scheduler.running and seq not in engine.scheduler.waiting
                out = by_id[str(seq.seq_id)]
                assert out.outputs[0].finish_reason == "error" and INJECTED in out.error
        assert all(s.num_scheduled_tokens == 0 for s in engine.scheduler.running)
        engine.scheduler.check_invariants()
    raise AssertionError("the engine did not finish: a hang")


def test_faults_on_the_fake_runner_under_load(make_engine) -> None:
    """30 requests on a small pool (chunked prefill, preemption), faults on three chosen
    steps and for one chosen sequence: each failed step commits nothing, only its batch
    ends with "error", the rest give exactly their fault-free tokens, no block leaks."""
    engine = make_engine(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=8)
    runner = FaultyRunner(engine.model_runner, fail_on_calls={3, 17, 40})
    engine.model_runner = runner
    prompts = random_prompts(30, seed=1, vocab=1000, lengths=(2, 40))
    max_tokens = [5 + i % 13 for i in range(30)]
    seqs = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens, strict=True)]
    chosen = seqs[21].seq_id
    runner.fail_when = lambda s: s.seq_id == chosen
    finals = step_checking_faults(engine)

    failed = {sid for f in runner.failures for sid in f.seq_ids}
    assert len(runner.failures) == 4 and chosen in failed
    assert engine.scheduler.num_preemptions > 0
    for seq, prompt, m in zip(seqs, prompts, max_tokens, strict=True):
        out = finals[str(seq.seq_id)].outputs[0]
        if seq.seq_id in failed:
            assert out.finish_reason == "error"
        else:
            assert out.finish_reason == "length"
            assert out.token_ids == reference_completion(prompt, m)
    assert len(failed) < len(seqs)  # the faults did not take everything down


def test_faults_on_the_tiny_model_under_preemption(base: LLMEngine) -> None:
    """The same on the real engine (tiny Llama): a 12-block pool forces preemption; the
    requests outside the failed batches match a fault-free run token for token."""
    prompts = random_prompts(16, seed=2, vocab=base.model_runner.vocab_size, lengths=(3, 60))
    max_tokens = [8 + i % 17 for i in range(16)]

    def run(engine: LLMEngine) -> tuple[list, dict]:
        seqs = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens, strict=True)]
        return seqs, step_checking_faults(engine)

    clean_seqs, clean = run(engine_on(base, max_num_seqs=8))
    engine = engine_on(base, num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=64)
    runner: FaultyRunner = engine.model_runner  # type: ignore[assignment]
    runner.fail_on_calls = {4, 15}
    poison = tuple(prompts[11])
    runner.fail_when = lambda s: tuple(s.prompt_token_ids) == poison
    seqs, finals = run(engine)

    assert engine.scheduler.num_preemptions > 0 and len(runner.failures) == 3
    failed = {sid for f in runner.failures for sid in f.seq_ids}
    for clean_seq, seq in zip(clean_seqs, seqs, strict=True):
        out = finals[str(seq.seq_id)].outputs[0]
        want = clean[str(clean_seq.seq_id)].outputs[0].token_ids
        if seq.seq_id in failed:
            assert out.finish_reason == "error" and want[: len(out.token_ids)] == out.token_ids
        else:
            assert out.token_ids == want
    assert_no_leaks(engine)


# ---- the live server ------------------------------------------------------------------------


@dataclass
class Live:
    base_url: str
    engine: LLMEngine

    @property
    def runner(self) -> FaultyRunner:
        return self.engine.model_runner  # type: ignore[return-value]

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.base_url)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits; return the last scrape."""
        return wait_idle(self.base_url, timeout)

    def works(self) -> None:
        """The follow-up every bad-input case ends with: a normal request is served."""
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3}
        r = httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.fixture(scope="module")
def live(base: LLMEngine) -> Iterator[Live]:
    """A live server (default limits: 4 MB bodies, no API key) on the tiny Llama, behind a
    FaultyRunner the fault tests arm and disarm."""
    engine = engine_on(base, max_num_seqs=16)
    with ServerThread(create_app(engine, MODEL)) as thread:
        yield Live(thread.base_url, engine)


def _events(lines: list[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_server_fault_ends_only_the_failed_batch(base: LLMEngine, live: Live) -> None:
    """Concurrent requests, half streamed, in three waves: short ones that finish, long ones
    still running when two poisoned requests arrive (the runner raises when their sequence
    is in the batch), then a wave sent after the fault. Every request of a failed batch ends
    with an error event (streamed) or a 500 JSON body; every other one returns exactly its
    fault-free greedy text; the server ends idle with kv usage 0 and keeps serving."""
    vocab = base.model_runner.vocab_size
    prompts = random_prompts(18, seed=3, vocab=vocab, lengths=(3, 40))
    poison = [7, 7, 7, 7, 7]
    short = [(p, 3, i % 2 == 0) for i, p in enumerate(prompts[:6])]
    long = [(p, 450, i % 2 == 0) for i, p in enumerate(prompts[6:10])]  # ended by the fault
    poisoned = [(poison, 12, True), (poison, 12, False)]
    after = [(p, 6 + i % 11, i % 2 == 0) for i, p in enumerate(prompts[10:])]
    plan = short + long + poisoned + after

    async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool):
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if not stream:
            r = await client.post("/v1/completions", json=body)
            return r.status_code, r.json()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            return r.status_code, _events([line async for line in r.aiter_lines()])

    async def main() -> list:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=60) as client:
            tasks = {}

            def send(specs: list) -> list[asyncio.Task]:
                for spec in specs:
                    tasks[id(spec)] = asyncio.ensure_future(one(client, *spec))
                return [tasks[id(spec)] for spec in specs]

            send(long)
            await asyncio.gather(*send(short))  # done before the fault
            await asyncio.gather(*send(poisoned))  # the long ones still run beside them
            send(after)
            return [await tasks[id(spec)] for spec in plan]

    live.runner.fail_when = lambda s: s.prompt_token_ids == poison
    try:
        results = asyncio.run(main())
    finally:
        live.runner.fail_when = None
    failed = live.runner.failed_prompts
    assert tuple(poison) in failed
    assert not failed & {tuple(p) for p, _, _ in short + after}  # done before / sent after
    assert failed & {tuple(p) for p, _, _ in long}, "the long requests ended before the fault"
    assert live.wait_idle()["minivllm:kv_cache_usage_perc"] == 0
    num_ok = 0
    for (prompt, max_tokens, stream), (status, body) in zip(plan, results, strict=True):
        if tuple(prompt) in failed:
            if stream:
                assert status == 200 and body[-1] == "[DONE]"
                error = body[-2]["error"]
            else:
                assert status == 500
                error = body["error"]
            assert error["type"] == "internal_server_error" and error["code"] == "engine_error"
            assert INJECTED in error["message"]
            continue
        num_ok += 1
        if stream:
            assert status == 200 and body[-1] == "[DONE]"
            text = "".join(c["choices"][0]["text"] for c in body[:-1])
            assert body[-2]["choices"][0]["finish_reason"] == "length"
        else:
            assert status == 200 and body["usage"]["completion_tokens"] == max_tokens
            text = body["choices"][0]["text"]
        # Its fault-free greedy text, generated alone once the server is idle again.
        alone = generate_alone(base, prompt, max_tokens)
        assert text == base.tokenizer.decode(alone, skip_special_tokens=True)
    assert num_ok > 0
    assert live.wait_idle()["minivllm:kv_cache_usage_perc"] == 0
    live.works()


# ---- the bad-input matrix ---------------------------------------------------------------------

_C = "/v1/completions"
_CHAT = "/v1/chat/completions"
_OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
_OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
_BIG = 12 * 1024 * 1024


def _chunked_big_body() -> Iterator[bytes]:
    yield b'{"prompt": "'
    for _ in range(_BIG // (1 << 20)):
        yield b"x" * (1 << 20)
    yield b'"}'


@dataclass(frozen=True)
class Http:
    """POST `body` (a dict as JSON, raw bytes, or a callable giving chunks) to `path`;
    expect `status` and, for errors, OpenAI's error JSON whose message holds `needle`."""

    path: str
    body: dict | bytes | Callable[[], Iterator[bytes]]
    status: int
    needle: str = ""
    param: str | None = None


@dataclass(frozen=True)
class Py:
    """Call `call(llm)`; expect `raises` (an exception type) with `needle` in its message,
    or no exception when `raises` is None."""

    call: Callable[[LLM], Any]
    raises: type[Exception] | None
    needle: str = ""


def _gen(prompt: Any, params: SamplingParams | None = None) -> Callable[[LLM], Any]:
    return lambda llm: llm.generate(prompt, params or greedy(2), use_tqdm=False)


def _add(prompt: Any, params: Any = None) -> Callable[[LLM], Any]:
    return lambda llm: llm.llm_engine.add_request(prompt, params)


def _params(**kw: Any) -> Callable[[LLM], Any]:
    return lambda llm: SamplingParams(**kw)


_LONG_STOP = [f"zq{i}" for i in range(1000)]

BAD_INPUT = [
    # ---- the Python API: LLM, LLMEngine.add_request, SamplingParams ----
    ("py-empty-prompt", Py(_gen(""), ValueError, "empty")),
    ("py-empty-token-ids", Py(_add({"prompt_token_ids": []}), ValueError, "empty")),
    ("py-prompt-too-long", Py(_gen([[5] * 600]), ValueError, "max_model_len (512)")),
    ("py-token-outside-vocab", Py(_gen([[1, 10**6]]), ValueError, "outside the vocabulary")),
    ("py-negative-token", Py(_add([4, -1]), ValueError, "outside the vocabulary")),
    ("py-float-token", Py(_add([4, 1.5]), ValueError, "outside the vocabulary")),
    ("py-max-tokens-negative", Py(_params(max_tokens=-1), ValueError, "max_tokens")),
    ("py-max-tokens-zero", Py(_params(max_tokens=0), ValueError, "max_tokens")),
    ("py-max-tokens-huge", Py(_gen("Hi", greedy(10**9)), ValueError, "max_model_len")),
    ("py-temperature-nan", Py(_params(temperature=float("nan")), ValueError, "temperature")),
    ("py-temperature-negative", Py(_params(temperature=-0.5), ValueError, "temperature")),
    ("py-temperature-string", Py(_params(temperature="0.5"), ValueError, "temperature")),
    ("py-top-p-zero", Py(_params(top_p=0.0), ValueError, "top_p")),
    ("py-top-p-over-one", Py(_params(top_p=1.01), ValueError, "top_p")),
    ("py-top-p-nan", Py(_params(top_p=float("nan")), ValueError, "top_p")),
    ("py-top-k-below-minus-one", Py(_params(top_k=-2), ValueError, "top_k")),
    ("py-n-zero", Py(_params(n=0), ValueError, "n must")),
    ("py-seed-string", Py(_params(seed="x"), ValueError, "seed")),
    ("py-stop-not-strings", Py(_params(stop=[1]), ValueError, "stop")),
    ("py-min-over-max", Py(_params(min_tokens=5, max_tokens=2), ValueError, "min_tokens")),
    ("py-prompt-int", Py(_gen(42), TypeError, "prompts must be")),
    ("py-prompt-none", Py(_gen(None), TypeError, "prompts must be")),
    ("py-params-dict", Py(_add("Hi", {"temperature": 0}), TypeError, "SamplingParams")),
    ("py-params-list-bad", Py(lambda llm: llm.generate(["a"], [1]), TypeError, "SamplingParams")),
    ("py-params-count", Py(lambda llm: llm.generate(["a", "b"], [greedy(2)]), ValueError, "got 1")),
    ("py-prompt-dict-keys", Py(_add({"text": "Hi"}), ValueError, "prompt_token_ids")),
    ("py-chat-not-list", Py(lambda llm: llm.chat("Hi", greedy(2)), TypeError, "list")),
    (
        "py-chat-no-role",
        Py(lambda llm: llm.chat([{"content": "Hi"}], greedy(2)), ValueError, "role"),
    ),
    ("py-unknown-model", Py(lambda llm: LLM("/no/such/model"), FileNotFoundError, "not exist")),
    ("py-unknown-option", Py(lambda llm: LLM(None, bogus=1), TypeError, "unknown engine option")),
    # A long stop list is the caller's business offline: accepted, and it works.
    ("py-long-stop-list-ok", Py(_gen("Hi", greedy(3, stop=_LONG_STOP)), None)),
    # ---- HTTP ----
    ("http-empty-prompt", Http(_C, {**_OK, "prompt": ""}, 400, "empty", "prompt")),
    ("http-empty-token-list", Http(_C, {**_OK, "prompt": []}, 400, "empty", "prompt")),
    ("http-prompt-too-long", Http(_C, {**_OK, "prompt": [5] * 600}, 400, "max_model_len is 512")),
    ("http-token-outside-vocab", Http(_C, {**_OK, "prompt": [1, 10**7]}, 400, "vocabulary")),
    ("http-negative-token", Http(_C, {**_OK, "prompt": [1, -3]}, 400, "vocabulary")),
    ("http-max-tokens-negative", Http(_CHAT, {**_OK_CHAT, "max_tokens": -5}, 400, "max_tokens")),
    ("http-max-tokens-zero", Http(_C, {**_OK, "max_tokens": 0}, 400, "max_tokens", "max_tokens")),
    ("http-max-tokens-huge", Http(_C, {**_OK, "max_tokens": 10**9}, 400, "max_model_len (512)")),
    ("http-max-tokens-string", Http(_C, {**_OK, "max_tokens": "5"}, 400, "max_tokens")),
    ("http-max-tokens-float", Http(_C, {**_OK, "max_tokens": 2.5}, 400, "max_tokens")),
    ("http-temperature-nan", Http(_C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature")),
    ("http-temperature-negative", Http(_C, {**_OK, "temperature": -1}, 400, "temperature")),
    ("http-temperature-string", Http(_C, {**_OK, "temperature": "hot"}, 400, "temperature")),
    ("http-top-p-zero", Http(_C, {**_OK, "top_p": 0}, 400, "top_p", "top_p")),
    ("http-top-p-over-one", Http(_CHAT, {**_OK_CHAT, "top_p": 1.5}, 400, "top_p", "top_p")),
    ("http-top-k-below-minus-one", Http(_C, {**_OK, "top_k": -2}, 400, "top_k", "top_k")),
    ("http-n-zero", Http(_C, {**_OK, "n": 0}, 400, "n must")),
    ("http-n-huge", Http(_CHAT, {**_OK_CHAT, "n": 10**6}, 400, "n must")),
    ("http-prompt-number", Http(_C, {**_OK, "prompt": 42}, 400, "prompt", "prompt")),
    ("http-stream-string", Http(_C, {**_OK, "stream": "yes"}, 400, "stream", "stream")),
    ("http-stop-number", Http(_C, {**_OK, "stop": 5}, 400, "stop", "stop")),
    ("http-long-stop-list", Http(_C, {**_OK, "stop": _LONG_STOP}, 400, "at most 64", "stop")),
    ("http-malformed-json", Http(_C, b'{"prompt": ', 400, "not valid JSON")),
    ("http-empty-body", Http(_C, b"", 400, "not valid JSON")),
    ("http-body-not-object", Http(_CHAT, b'["Hi"]', 400, "JSON object")),
    ("http-non-utf8", Http(_C, b'{"prompt": "\xff\xfe"}', 400, "UTF-8")),
    ("http-12mb-body", Http(_C, b"x" * _BIG, 413, "over the limit")),
    ("http-12mb-chunked-body", Http(_C, _chunked_big_body, 413, "over the limit")),
    ("http-unknown-model", Http(_C, {**_OK, "model": "gpt-9"}, 404, "gpt-9", "model")),
    ("http-unknown-model-chat", Http(_CHAT, {**_OK_CHAT, "model": "gpt-9"}, 404, "gpt-9")),
    ("http-messages-not-list", Http(_CHAT, {**_OK_CHAT, "messages": "Hi"}, 400, "messages")),
    ("http-messages-empty", Http(_CHAT, {**_OK_CHAT, "messages": []}, 400, "messages")),
    (
        "http-message-no-role",
        Http(_CHAT, {**_OK_CHAT, "messages": [{"content": "Hi"}]}, 400, "role"),
    ),
    ("http-message-not-object", Http(_CHAT, {**_OK_CHAT, "messages": ["Hi"]}, 400, "messages")),
    (
        "http-message-content-number",
        Http(_CHAT, {**_OK_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ),
    (
        "http-image-part",
        Http(
            _CHAT,
            {**_OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "text content",
        ),
    ),
    (
        "http-top-logprobs-without-logprobs",
        Http(_CHAT, {**_OK_CHAT, "top_logprobs": 2}, 400, "needs logprobs"),
    ),
    # A top-level field this server does not implement is a 400 naming it (an answer that
    # ignored it would not be the one asked for); informational fields (user, metadata,
    # store) are accepted, and so are unknown keys inside messages (clients echo back the
    # assistant messages they received).
    (
        "http-unknown-field-refused",
        Http(_C, {**_OK, "frobnicate": True}, 400, "frobnicate", "frobnicate"),
    ),
    (
        "http-audio-refused",
        Http(_CHAT, {**_OK_CHAT, "modalities": ["audio"]}, 400, "modalities", "modalities"),
    ),
    (
        "http-informational-accepted",
        Http(
            _C, {**_OK, "user": "u", "metadata": {"a": "b"}, "store": True, "logit_bias": {}}, 200
        ),
    ),
    (
        "http-unknown-message-keys-ignored",
        Http(
            _CHAT,
            {**_OK_CHAT, "messages": [{"role": "user", "content": "Hi", "x": 1}]},
            200,
        ),
    ),
]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(
        str(tiny_llama_dir),
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        dtype="float32",
    )


def _post(live: Live, case: Http) -> httpx.Response:
    url = f"{live.base_url}{case.path}"
    if isinstance(case.body, dict):
        return httpx.post(url, json=case.body, timeout=30)
    content = case.body() if callable(case.body) else case.body
    try:
        return httpx.post(url, content=content, timeout=30)
    except httpx.TransportError:
        # The server may answer 413 and close before a huge body is sent; read the answer
        # on a body small enough to be sent whole, with the same declared length.
        headers = {"content-length": str(_BIG), "content-type": "application/json"}
        with httpx.Client(timeout=30) as client:
            request = client.build_request("POST", url, headers=headers, content=b"")
            return client.send(request)


@pytest.mark.parametrize("case", [c[1] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_matrix(case: Py | Http, request: pytest.FixtureRequest) -> None:
    """Each bad input gets a clear error (Python: the exception type and a message naming
    what to change; HTTP: the status and OpenAI's error JSON), and afterwards the engine
    serves a normal request with nothing leaked."""
    if isinstance(case, Py):
        llm: LLM = request.getfixturevalue("llm")
        if case.raises is None:
            case.call(llm)
        else:
            with pytest.raises(case.raises) as info:
                case.call(llm)
            assert case.needle in str(info.value), info.value
        assert not llm.llm_engine.has_unfinished_requests()
        (out,) = llm.generate("The quick brown fox", greedy(3), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
        assert_no_leaks(llm.llm_engine)
        return
    live: Live = request.getfixturevalue("live")
    r = _post(live, case)
    assert r.status_code == case.status, r.text
    body = r.json()
    if case.status == 200:
        assert body["choices"] and body["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert case.needle in error["message"], error
        if case.param is not None:
            assert error["param"] == case.param, error
    live.works()
    assert live.wait_idle()["minivllm:kv_cache_usage_perc"] == 0


# ---- determinism under batching ------------------------------------------------------------


def _alone_vs_busy(
    base: LLMEngine,
    prompts: list[list[int]],
    max_tokens: list[int],
    target: int,
    **busy_config: Any,
) -> tuple[list[int], list[int], LLMEngine]:
    alone = generate_alone(base, prompts[target], max_tokens[target])
    engine = engine_on(base, **busy_config)
    seqs = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens, strict=True)]
    finals = run_to_completion(engine)
    return alone, finals[str(seqs[target].seq_id)].outputs[0].token_ids, engine


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_qwen3_dir"])
def test_greedy_is_the_same_alone_and_in_a_busy_batch(model: str, request) -> None:
    """fp32 on CPU: each of three greedy requests gives the same tokens alone and inside a
    batch of 20 (chunked prefill on a 64-token budget, a 24-block pool that preempts)."""
    base = _base_engine(request.getfixturevalue(model))
    vocab = base.model_runner.vocab_size
    prompts = random_prompts(20, seed=4, vocab=vocab, lengths=(3, 90))
    max_tokens = [10 + (7 * i) % 30 for i in range(20)]
    engine = engine_on(base, num_kv_blocks=24, max_num_seqs=12, max_num_batched_tokens=64)
    seqs = [engine.add_request(p, greedy(m)) for p, m in zip(prompts, max_tokens, strict=True)]
    finals = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0
    for i in (0, 9, 17):
        busy = finals[str(seqs[i].seq_id)].outputs[0].token_ids
        assert busy == generate_alone(base, prompts[i], max_tokens[i]), f"request {i}"


@pytest.mark.default_model
def test_default_model_greedy_is_the_same_alone_and_in_a_busy_batch(default_llm_fp32) -> None:
    """The same on SmolLM2-135M (fp32, CPU): one chat-length request alone, then inside a
    batch of 8 of mixed lengths with chunked prefill. (With bf16 and int4 weights the kernel
    depends on the step's row count, so batch invariance holds on dtype="float32".)"""
    base = default_llm_fp32.llm_engine
    tokenizer = base.tokenizer
    texts = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Once upon a time, in a land far away,",
        "def fibonacci(n):",
        "The KV cache stores",
        "1, 2, 3, 4,",
        "Explain paged attention in one line.",
        "Hello! How are you today? " * 6,
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    max_tokens = [16] * len(prompts)
    alone, busy, _ = _alone_vs_busy(base, prompts, max_tokens, target=0, max_num_batched_tokens=32)
    assert busy == alone
