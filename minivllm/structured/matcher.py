"""The engine's grammar matching: one matcher per constrained request, the batch's token
bitmask before a step, the committed tokens fed back after it.

The bitmask is llguidance's (and vLLM's) layout: int32 `[rows, ceil(vocab / 32)]`, bit `j`
of word `w` set when token `32 * w + j` is allowed; a row of all ones constrains nothing.
Everything runs on the engine's thread; llguidance's view of the tokenizer (half a second for
a 49k vocabulary) is built at the first constrained request, so engines that never see one
pay nothing.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from minivllm.sampling_params import SamplingParams
from minivllm.structured.grammar import GrammarError, compile_grammar

_PRISTINE_CACHE = 64  # compiled matchers kept, copied per request
_MASK_THREADS = min(4, os.cpu_count() or 1)  # masks filled in parallel (batches of 2+)


class GrammarMatcher:
    """Where one request is in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past a committed token (one the mask allowed)."""
        self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar has ended: no token but EOS can follow (or the matcher failed)."""
        return self._matcher.is_stopped() or self._matcher.is_error()


class StructuredOutputs:
    """Makes the per-request matchers of one engine and the batch's bitmask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._pristine: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def matcher_for(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher for a request's constraint, None if it has none; GrammarError
        (a ValueError) if the constraint does not compile."""
        spec = params.structured_outputs
        if spec is None:
            return None
        base = self._pristine.get(spec.key)
        if base is None:
            base = llguidance.LLMatcher(self._tokenizer(), compile_grammar(spec), log_level=0)
            if base.is_error():
                raise GrammarError(spec.kind, base.get_error())
            self._pristine[spec.key] = base
            if len(self._pristine) > _PRISTINE_CACHE:
                self._pristine.popitem(last=False)
        self._pristine.move_to_end(spec.key)
        return GrammarMatcher(base.deep_copy())

    def bitmask(self, matchers: list[GrammarMatcher | None]) -> np.ndarray | None:
        """The token bitmask of a batch's sampling rows; None if no row is constrained."""
        rows = [(m._matcher, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = llnp.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(rows) == 1:  # one request: no thread pool to wake
            llnp.fill_next_token_bitmask(rows[0][0], bitmask, rows[0][1])
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=_MASK_THREADS)
            llnp.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        words = bitmask.view(np.uint32)  # [rows, ceil(vocab / 32)], the same bits
        for _, i in rows:
            if not words[i].any():  # never leave a request with no token at all: let it end
                for eos in self.eos_token_ids:
                    words[i, eos // 32] |= np.uint32(1 << (eos % 32))
        return bitmask

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            import llguidance.hf  # imports transformers: only once a request needs it

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._ll_tokenizer
