"""The grammar mask on the tiny tokenizer, checked against oracles written without llguidance:
every token the mask allows keeps the text a prefix of some string of the language, and the
mask never leaves a request with no token at all."""

from __future__ import annotations

import itertools
import json
import random
import re

import numpy as np
import pytest
import torch
from support.model_fixtures import TINY_VOCAB_SIZE, build_tokenizer

from minivllm.layers.sampler import allowed_tokens, apply_token_bitmask, unpack_words
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.structured import GrammarError, StructuredOutputs, compile_grammar

EOS = 1  # the tiny tokenizer's </s>

# Finite languages, so that "a prefix of some string of the language" is checked by listing.
CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[ab]{1,3}-[0-9]"
REGEX_STRINGS = [
    "".join(p) + "-" + d
    for n in (1, 2, 3)
    for p in itertools.product("ab", repeat=n)
    for d in "0123456789"
]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": [1, 22]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMA_STRINGS = [
    json.dumps({"a": a, "b": b}, separators=(",", ":")) for a in (1, 22) for b in (True, False)
]
CASES = [
    ("choice", StructuredOutputsParams(choice=CHOICES), CHOICES),
    ("regex", StructuredOutputsParams(regex=REGEX), REGEX_STRINGS),
    ("json", StructuredOutputsParams(json=SCHEMA), SCHEMA_STRINGS),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _allowed(bitmask: np.ndarray) -> list[int]:
    return (
        torch.nonzero(allowed_tokens(torch.from_numpy(bitmask), TINY_VOCAB_SIZE)[0])
        .flatten()
        .tolist()
    )


@pytest.mark.parametrize("spec, language", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_allowed_token_keeps_a_valid_prefix(tokenizer, spec, language) -> None:
    """Random walks through the mask: at every step every allowed token (EOS aside) extends
    the text to a prefix of the language, EOS only where the text is complete, and the walk
    ends on a string of the language."""
    structured = StructuredOutputs(tokenizer, TINY_VOCAB_SIZE, (EOS,))
    rng = random.Random(0)
    for _ in range(8):
        matcher = structured.matcher_for(SamplingParams(structured_outputs=spec))
        tokens: list[int] = []
        while not matcher.is_finished:
            allowed = _allowed(structured.bitmask([matcher]))
            assert allowed, "the mask left no token"
            text = tokenizer.decode(tokens)
            for t in allowed:
                if t == EOS:
                    assert text in language, text
                else:
                    longer = tokenizer.decode(tokens + [t])
                    assert any(s.startswith(longer) for s in language), (text, longer)
            choice = rng.choice([t for t in allowed if t != EOS] or allowed)
            if choice == EOS:
                break
            matcher.accept(choice)
            tokens.append(choice)
        assert tokenizer.decode(tokens) in language


def test_unconstrained_rows_are_all_ones_and_none_without_constraints(tokenizer) -> None:
    structured = StructuredOutputs(tokenizer, TINY_VOCAB_SIZE, (EOS,))
    assert structured.bitmask([None, None]) is None
    matcher = structured.matcher_for(
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes"]))
    )
    bitmask = structured.bitmask([None, matcher])
    assert len(_allowed(bitmask[:1])) == TINY_VOCAB_SIZE
    assert 0 < len(_allowed(bitmask[1:])) < 10


@pytest.mark.parametrize("spec, language", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_sequence_with_drafts_gets_one_mask_per_verified_row(tokenizer, spec, language):
    """Speculative decoding: a constrained sequence with k drafts owns k + 1 rows, row j the
    mask after its first j drafts, as k + 1 one-token steps would have seen; the drafts are
    cut to what the grammar allows, and the matcher is back where it started."""
    structured = StructuredOutputs(tokenizer, TINY_VOCAB_SIZE, (EOS,))
    params = SamplingParams(structured_outputs=spec)
    text = language[-1]
    tokens = tokenizer.encode(text, add_special_tokens=False)
    matcher = structured.matcher_for(params)
    assert matcher.valid_prefix(tokens + tokens) == len(tokens)  # nothing after the end
    other = structured.matcher_for(params)  # a second sequence, without drafts
    drafts = tokens[:3]
    bitmask = structured.bitmask([other, None, matcher], [[], [5, 6], drafts])
    assert bitmask.shape[0] == 1 + 3 + 1 + len(drafts)
    assert len(_allowed(bitmask[1:2])) == TINY_VOCAB_SIZE  # unconstrained rows: all ones
    reference = structured.matcher_for(params)
    for j in range(len(drafts) + 1):
        want = _allowed(structured.bitmask([reference]))
        assert _allowed(bitmask[4 + j : 5 + j]) == want, j
        if j < len(drafts):
            reference.accept(drafts[j])
    assert _allowed(structured.bitmask([matcher])) == _allowed(bitmask[4:5])  # rolled back


def test_apply_token_bitmask_matches_a_bit_by_bit_reference() -> None:
    """Bit j of word w allows token 32w + j, the sign bit (j = 31) included; tokens past the
    mask's words are not allowed."""
    rng = np.random.default_rng(0)
    vocab = 100
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, vocab + 30)
    want = logits.clone()
    for row, token in itertools.product(range(3), range(vocab + 30)):
        word = int(bitmask[row, token // 32]) & 0xFFFFFFFF if token < 128 else 0
        if not (word >> (token % 32)) & 1:
            want[row, token] = float("-inf")
    got = apply_token_bitmask(logits, torch.from_numpy(bitmask))
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutputsParams(json={"type": "nope"}), "json"),
        (StructuredOutputsParams(regex="(unclosed"), "regex"),
        (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
        (StructuredOutputsParams(json="{not json"), "json"),
    ],
)
def test_bad_specs_raise_grammar_errors_naming_the_field(spec, field) -> None:
    with pytest.raises(GrammarError, match=f"structured_outputs.{field}") as info:
        compile_grammar(spec)
    assert info.value.field == field


@pytest.mark.parametrize(
    "kw", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"json": 3}]
)
def test_structured_outputs_params_needs_exactly_one_valid_constraint(kw) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kw)


def test_the_regex_oracle_is_the_regex() -> None:
    assert all(re.fullmatch(REGEX, s) for s in REGEX_STRINGS)


@pytest.mark.parametrize("vocab", [5, 32, 70, 100])
def test_device_unpacking_matches_the_host_unpacking(vocab) -> None:
    """The accelerator's shift-based unpacking of the packed mask allows exactly the tokens the
    host's byte-wise unpacking allows, sign bit and a vocabulary past 32W included."""
    rng = np.random.default_rng(vocab)
    words = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64))
    words = words.to(torch.int32)
    words[0, 0] = -1  # every bit, the sign bit too
    assert torch.equal(unpack_words(words, vocab), allowed_tokens(words, vocab))
