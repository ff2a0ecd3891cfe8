"""`PoolingParams`: how an embedding request pools its prompt's hidden states (vLLM's name).

An embedding request runs through the engine like any other: a prefill-only sequence that
finishes when its whole prompt has run, handing back its pooled final hidden state (the one
the LM head would read) instead of a sampled token.

Pure Python: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """`method`: last (the last prompt token's state: decoder models), mean (the average over
    the prompt) or cls (the first token's); None: the engine's `pooling` option, which the
    model's sentence-transformers config sets where it has one. `normalize`: L2-normalize the
    pooled vector, vLLM's default for embeddings."""

    method: str | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ValueError(
                f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
