"""Paged KV cache arithmetic shared by the engine (which plans blocks) and the layers (which
index them): pure Python, no torch, so both floors may import it."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """ceil(num_tokens / block_size): the KV blocks that hold `num_tokens` tokens."""
    return (num_tokens + block_size - 1) // block_size
