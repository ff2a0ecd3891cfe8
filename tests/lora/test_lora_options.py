"""The LoRA options and the torch-free pieces: the CLI's `--lora-modules name=path ...`, the
option checks, the named-adapter registry's ids, and the prefix cache's per-adapter root."""

from __future__ import annotations

import argparse

import pytest

from minivllm.cli import add_engine_options, engine_fields
from minivllm.config import EngineConfig
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.lora_registry import LoRARegistry
from minivllm.engine.sequence import Sequence


def test_the_cli_takes_several_lora_modules() -> None:
    """`--enable-lora --lora-modules a=/x b=/y` becomes the config's two name=path entries."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", "b=/y"])
    options = {f.name: getattr(args, f.name) for f in engine_fields()}
    config = EngineConfig.from_options(**{k: v for k, v in options.items() if v is not None})
    assert config.enable_lora and config.lora_modules == ("a=/x", "b=/y")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(enable_lora=True, lora_modules=("nopath",)), "name=path"),
        (dict(lora_modules=("a=/x",)), "needs enable_lora"),
        (dict(enable_lora=True, max_loras=0), "max_loras"),
        (dict(enable_lora=True, max_lora_rank=-1), "max_lora_rank"),
        (dict(enable_lora=True, tensor_parallel_size=2), "tensor_parallel_size"),
    ],
)
def test_bad_lora_options_are_refused(options: dict, message: str) -> None:
    """Each bad LoRA option is a ValueError that names it."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_the_registry_numbers_start_up_adapters_first_and_never_reuses_an_id() -> None:
    """lora_modules get ids 1.. in order (the runner preloads them under the same ids); a name
    removed and added again gets a fresh id, so it never meets the old adapter's blocks."""
    config = EngineConfig(enable_lora=True, lora_modules=("a=/x", "b=/y"))
    registry = LoRARegistry(config)
    assert [registry.get(n).lora_int_id for n in registry.names()] == [1, 2]
    registry.remove("a")
    with pytest.raises(ValueError, match="no LoRA adapter is named 'a'"):
        registry.get("a")
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        LoRARegistry(EngineConfig()).add("c", "/z")


def test_a_prefix_cached_under_one_adapter_matches_only_that_adapter() -> None:
    """The first block's hash folds in the adapter id: the same tokens under another adapter,
    or the base model, find nothing."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10, 19))
    first = Sequence(0, tokens)
    first.lora_int_id = 3
    bm.allocate(first, 9)
    first.num_cached_tokens = 8
    bm.commit(first, 0)
    for lora_id, want in [(3, 2), (4, 0), (0, 0)]:
        other = Sequence(1, tokens)
        other.lora_int_id = lora_id
        assert len(bm.match_prefix(other)) == want, lora_id
