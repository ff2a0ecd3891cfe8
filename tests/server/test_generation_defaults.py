"""The model's generation_config.json sampling defaults, applied as vLLM applies them: a field a
request leaves unset takes the model's value, one it sets wins (chat and completions, and
`LLM.get_default_sampling_params()` offline); `generation_config="vllm"` ignores the file."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from minivllm import LLM, SamplingParams
from minivllm.server import ServerThread, create_app
from minivllm.server.openai import protocol

# top_k 1 makes the model's default greedy: outputs that follow it are deterministic.
MODEL_DEFAULTS = {
    "temperature": 0.5,
    "top_k": 1,
    "top_p": 0.9,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
}
AS_SAMPLING_PARAMS = {**MODEL_DEFAULTS, "max_tokens": 5}
del AS_SAMPLING_PARAMS["max_new_tokens"]
MAX_MODEL_LEN = 64
MESSAGES = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with sampling values in its generation_config.json."""
    out = tmp_path_factory.mktemp("tiny_llama_gen")
    for item in tiny_llama_dir.iterdir():
        shutil.copy(item, out / item.name)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, **MODEL_DEFAULTS}))
    return out


def _llm(model_dir: Path, generation_config: str) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        generation_config=generation_config,
    )


@pytest.fixture(scope="module", params=["auto", "vllm"])
def server(request, model_dir: Path) -> Iterator[tuple[str, object, openai.OpenAI]]:
    """(generation_config, the OpenAIServer, an openai client) on a live server."""
    app = create_app(_llm(model_dir, request.param).llm_engine, "tiny")
    with ServerThread(app) as thread:
        client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="x", max_retries=0)
        yield request.param, app.state.server, client
        client.close()


def built_params(server, body: dict, chat: bool = True) -> SamplingParams:
    """The SamplingParams the serving layer builds for a request body."""
    if chat:
        req = protocol.ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
        default_max = server.default_sampling.get("max_tokens")
    else:
        req = protocol.CompletionRequest.model_validate({"prompt": "Hi", **body})
        default_max = 16
    return asyncio.run(server.sampling_params(req, default_max, None))


def test_unset_fields_take_the_model_defaults_and_set_ones_win(server):
    source, srv, _ = server
    neutral = SamplingParams(max_tokens=None)
    got = built_params(srv, {})
    fields = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens"]
    want = AS_SAMPLING_PARAMS if source == "auto" else {f: getattr(neutral, f) for f in fields}
    assert {f: getattr(got, f) for f in fields} == want
    mine = built_params(srv, {"temperature": 1.5, "top_k": -1, "max_tokens": 9})
    assert (mine.temperature, mine.top_k, mine.max_tokens) == (1.5, -1, 9)
    assert mine.top_p == want["top_p"]  # the fields it did not set keep the defaults
    completion = built_params(srv, {}, chat=False)
    assert completion.max_tokens == 16  # completions' own default, as vLLM's request model
    assert completion.temperature == want["temperature"]


def test_chat_outcomes_follow_the_defaults(server):
    """With the model's defaults (greedy, 5 tokens) a request that sets nothing gives the
    greedy answer whatever its seed, and its own temperature and top_k sample again; without
    them it samples at temperature 1 up to max_model_len."""
    source, _, client = server

    def chat(**body) -> tuple[str, int, int]:
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, extra_body={"ignore_eos": True, **body}
        )
        return r.choices[0].message.content, r.usage.completion_tokens, r.usage.prompt_tokens

    plain = {chat(seed=s) for s in range(4)}
    hot = {chat(seed=s, temperature=2.0, top_k=-1, max_tokens=5) for s in range(4)}
    assert len(hot) > 1
    if source == "auto":
        assert plain == {chat(temperature=0, repetition_penalty=1.1, max_tokens=5)}
        assert next(iter(plain))[1] == 5
    else:
        assert len(plain) > 1
        assert all(n == MAX_MODEL_LEN - prompt for _, n, prompt in plain)


def test_the_default_max_tokens_is_cut_to_the_room_left(server):
    """vLLM's rule: the model's max_tokens is capped by max_model_len - prompt; a request's
    own max_tokens is checked, not cut (too large is a 400)."""
    source, srv, client = server
    content = "Hello"
    while (
        len(srv.encode(srv.chat_text([{"role": "user", "content": content}], True), False))
        < MAX_MODEL_LEN - 3
    ):
        content += " world"
    messages = [{"role": "user", "content": content}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, extra_body={"ignore_eos": True}
    )
    room = MAX_MODEL_LEN - r.usage.prompt_tokens
    assert 0 < room < 5
    assert r.usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)


def test_offline_defaults(model_dir):
    """LLM.get_default_sampling_params() holds the model's values, and generate() without
    SamplingParams uses them; generation_config="vllm" gives SamplingParams()."""
    llm = _llm(model_dir, "auto")
    assert llm.get_default_sampling_params() == SamplingParams(**AS_SAMPLING_PARAMS)
    prompts = [[5, 17, 42, 99], [7, 8, 9]]
    implicit = llm.generate(prompts, use_tqdm=False)
    explicit = llm.generate(prompts, SamplingParams(**AS_SAMPLING_PARAMS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in implicit] == [o.outputs[0].token_ids for o in explicit]
    chat = llm.chat(MESSAGES, use_tqdm=False)[0].outputs[0]
    assert len(chat.token_ids) <= 5
    assert _llm(model_dir, "vllm").get_default_sampling_params() == SamplingParams()
