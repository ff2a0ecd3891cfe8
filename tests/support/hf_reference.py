"""References the engine is checked against: the sampler's penalties as the rules are written
(one row at a time), greedy decoding on HF transformers that recomputes the whole sequence
each step, and HF's prompt log-probabilities."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModel, AutoModelForCausalLM

from minivllm import SamplingParams


def reference_penalties(logits, tokens, num_prompt, repetition, presence, frequency):
    """One row, the rules as written: repetition over prompt + completion (HF), then frequency
    and presence over the completion (OpenAI)."""
    out = logits.clone()
    completion = tokens[num_prompt:]
    for token in set(tokens):
        value = out[token].item()
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(completion):
        count = completion.count(token)
        out[token] -= frequency * count + presence
    return out


@functools.cache
def hf_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding by recomputing the whole sequence each step, penalties in Python."""
    model = hf_model(model_dir)
    tokens = list(prompt)
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        logits = reference_penalties(
            logits,
            tokens,
            len(prompt),
            params.repetition_penalty,
            params.presence_penalty,
            params.frequency_penalty,
        )
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


@functools.cache
def hf_prompt_logprobs(model_dir: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[len(prompt) - 1, V]: the log-softmax at positions 0..n-2, which score tokens 1..n-1."""
    model = hf_model(model_dir)
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


@functools.cache
def hf_base_model(model_dir: str):
    """HF's `AutoModel`: the decoder without its LM head (`last_hidden_state`)."""
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_embedding(model_dir: str, ids: list[int], method: str, normalize: bool = True):
    """HF's final hidden states of `ids` pooled by `method` (last, mean, cls), L2-normalized
    unless `normalize` is False: what an embedding request must give."""
    hidden = hf_base_model(model_dir)(torch.tensor([ids])).last_hidden_state[0]  # [len, hidden]
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled
