"""Structured outputs: a completion constrained to a JSON schema, regex, choice or grammar.

`grammar.py` turns a StructuredOutputsParams into a checked llguidance grammar (cached by its
spec); `matcher.py` keeps one matcher per request, fills the batch's token bitmask before a
step and advances the matchers with the committed tokens after it. The sampler applies the
bitmask (`layers/sampler.py`); the engine ends a request where its grammar ends.
"""

from minivllm.structured.grammar import GrammarError, compile_grammar
from minivllm.structured.matcher import GrammarMatcher, StructuredOutputs

__all__ = ["GrammarError", "GrammarMatcher", "StructuredOutputs", "compile_grammar"]
