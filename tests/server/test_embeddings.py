"""POST /v1/embeddings through the openai SDK against HF's pooled hidden states.

Guards: OpenAI's response shape (float and base64, usage), every input form (a string, a list
of strings, token ids, lists of token ids), mean pooling over a prompt chunked by a small
token budget, and bad input answered with a 400 in OpenAI's error shape naming the field.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from support.hf_reference import hf_embedding
from transformers import AutoTokenizer

from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.runtime.engine_process import EngineProcess
from minivllm.server import ServerThread, create_app

TEXTS = ["The quick brown fox jumps over the lazy dog. Paged attention", "Hello, world!"]
MAX_MODEL_LEN = 64
COSINE = 0.999


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[tuple[str, openai.OpenAI, Path]]:
    engine = LLMEngine.from_options(
        model=str(tiny_llama_dir),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=64,
        max_num_batched_tokens=16,  # the first text runs in chunks
        device="cpu",
        dtype="float32",
        pooling="mean",
    )
    with ServerThread(create_app(engine, "tiny")) as thread:
        client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="x", max_retries=0)
        yield thread.base_url, client, tiny_llama_dir
        client.close()


def assert_matches_hf(model_dir: Path, ids: list[int], embedding: list[float]) -> None:
    cosine = torch.dot(torch.tensor(embedding), hf_embedding(str(model_dir), ids, "mean"))
    assert cosine.item() >= COSINE


def test_strings_float_and_base64(server) -> None:
    """A list of strings comes back in order, each HF's mean-pooled state, as floats, as
    base64 float32, and as the SDK's own default (base64 decoded by the client)."""
    _, client, model_dir = server
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer.encode(t) for t in TEXTS]
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == "tiny"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for item, prompt in zip(floats.data, ids):
        assert len(item.embedding) == 64
        assert_matches_hf(model_dir, prompt, item.embedding)
    raw = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="base64")
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    decoded = list(struct.unpack("<64f", base64.b64decode(encoded)))
    assert decoded == pytest.approx(floats.data[1].embedding, abs=1e-6)
    default = client.embeddings.create(model="tiny", input=TEXTS[1])
    assert list(default.data[0].embedding) == pytest.approx(decoded, abs=1e-6)


def test_token_id_inputs(server) -> None:
    """Token ids, one list or several, are prompts as given (no special tokens added); a
    prompt may fill max_model_len."""
    _, client, model_dir = server
    one = client.embeddings.create(model="tiny", input=[5, 6, 7], encoding_format="float")
    assert one.usage.prompt_tokens == 3
    assert_matches_hf(model_dir, [5, 6, 7], one.data[0].embedding)
    many = client.embeddings.create(
        model="tiny", input=[[5, 6, 7], [9] * MAX_MODEL_LEN], encoding_format="float"
    )
    assert many.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-5)
    assert_matches_hf(model_dir, [9] * MAX_MODEL_LEN, many.data[1].embedding)
    # one token alone: a step of query length 1, shaped as a decode
    single = client.embeddings.create(model="tiny", input=[5], encoding_format="float")
    assert_matches_hf(model_dir, [5], single.data[0].embedding)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1] * (MAX_MODEL_LEN + 1)}, "input"),
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 3}, "input"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param) -> None:
    """Empty input, input past max_model_len, an unsupported dimensions or format, a wrong
    type: a 400 in OpenAI's error shape, with the field in `param`."""
    base_url, _, _ = server
    response = httpx.post(f"{base_url}/v1/embeddings", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_token_id_outside_the_vocabulary(server) -> None:
    """A token id the model has no row for is a 400 through the SDK, not a crash."""
    _, client, _ = server
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.embeddings.create(model="tiny", input=[[1, 10**6]])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


@pytest.mark.slow  # a process of its own loads the model: tens of seconds on a busy machine
def test_through_the_engine_process(server) -> None:
    """`minivllm serve`'s default, the engine loop in a process of its own: the pooling
    request and its vector cross the pipe (cls pooling, the option passed through)."""
    _, _, model_dir = server
    engine = EngineProcess(
        {
            "model": str(model_dir),
            "device": "cpu",
            "dtype": "float32",
            "pooling": "cls",
            "enforce_eager": True,
        }
    )
    with ServerThread(create_app(engine, "tiny")) as thread:
        client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="x", max_retries=0)
        out = client.embeddings.create(model="tiny", input=[[5, 6, 7]], encoding_format="float")
        client.close()
    cosine = torch.dot(
        torch.tensor(out.data[0].embedding), hf_embedding(str(model_dir), [5], "cls")
    )
    assert cosine.item() >= COSINE
