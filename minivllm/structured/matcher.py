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

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (draft tokens) the grammar allows in a row from here."""
        if self.is_finished:
            return 0
        return int(self._matcher.validate_tokens(token_ids))

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

    def bitmask(
        self, matchers: list[GrammarMatcher | None], drafts: list[list[int]] | None = None
    ) -> np.ndarray | None:
        """The token bitmask of a batch's sampler rows; None if no row is constrained. With
        `drafts` (per sequence), a sequence owns 1 + len(drafts) rows, row j the mask after
        its drafts before j (each draft is one the grammar allows: `valid_prefix`)."""
        if all(m is None for m in matchers):
            return None
        counts = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(matchers)
        firsts = np.cumsum([0, *counts[:-1]]).tolist()  # each sequence's first row
        bitmask = llnp.allocate_token_bitmask(sum(counts), self.vocab_size)
        rows = [
            (m._matcher, firsts[i])
            for i, m in enumerate(matchers)
            if m is not None and counts[i] == 1
        ]
        if len(rows) == 1:  # one request: no thread pool to wake
            llnp.fill_next_token_bitmask(rows[0][0], bitmask, rows[0][1])
        elif rows:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=_MASK_THREADS)
            llnp.fill_next_token_bitmask_par(self._executor, rows, bitmask)
        for i, m in enumerate(matchers):  # with drafts: row by row, then back to the start
            if m is not None and counts[i] > 1:
                assert drafts is not None
                for j, token in enumerate(drafts[i]):
                    llnp.fill_next_token_bitmask(m._matcher, bitmask, firsts[i] + j)
                    m._matcher.consume_token(token)
                llnp.fill_next_token_bitmask(m._matcher, bitmask, firsts[i] + counts[i] - 1)
                m._matcher.rollback(counts[i] - 1)
        words = bitmask.view(np.uint32)  # [rows, ceil(vocab / 32)], the same bits
        for i, m in enumerate(matchers):
            for row in range(firsts[i], firsts[i] + counts[i]) if m is not None else ():
                if not words[row].any():  # never leave a request with no token: let it end
                    for eos in self.eos_token_ids:
                        words[row, eos // 32] |= np.uint32(1 << (eos % 32))
        return bitmask

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            import llguidance.hf  # imports transformers: only once a request needs it

            from minivllm.tokenizer import whole_tokenizer  # merges included: grammars encode

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                whole_tokenizer(self.tokenizer),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids or None,
            )
        return self._ll_tokenizer
