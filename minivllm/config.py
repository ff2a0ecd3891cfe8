"""The engine's options, vLLM's names where they exist, frozen after construction.

Values that depend on the model (for example `max_model_len` when not given) are resolved
once, by building a new config with `dataclasses.replace`; nothing writes to a config later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


def _option(
    default: Any, help: str, choices: tuple[str, ...] | None = None, cli: bool = True
) -> Any:
    """A config field with its help text: the CLI's `--flags` are made from these."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


def cli_flag(name: str, negated: bool = False) -> str:
    """The command-line flag of option `name`: `--max-num-seqs`, or for a switch that turns an
    option off, `--no-prefix-caching` (`enable_` dropped)."""
    if negated:
        return "--no-" + name.removeprefix("enable_").replace("_", "-")
    return "--" + name.replace("_", "-")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# `speculative_config`'s off switch, as the CLI gives it (unset means the engine's default).
SPECULATION_OFF = '{"method": "none"}'
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config` shape: up to `num_speculative_tokens`
    draft tokens per decoding sequence, which the target model verifies all in one step.
    `method="ngram"` proposes them by prompt lookup (the last n tokens, n from
    `prompt_lookup_max` down to `prompt_lookup_min`, found earlier in the prompt or output);
    `method="draft_model"` (vLLM infers it from a `model` key) runs the smaller model `model`
    (an HF directory or .gguf with the target's vocabulary) greedily, with a KV cache of its
    own (`engine/draft_model.py`).

    When it pays (`engine/spec_policy.py`): nobody speculates with `disable_by_batch_size` or
    more running sequences (None: at any batch size; lowered at start-up to where the measured
    steps say fully accepted drafts stop paying, `engine/spec_cost.py`), and a sequence proposes
    only while its acceptance so far beats the break-even of the cost model, whose one figure
    is `draft_token_cost`, a token's share of a one-token step's time (0: always propose, and
    no measurement; None, the default: measured on the loaded model at start-up)."""

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = 256
    draft_token_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; supported: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                'speculative_config method "draft_model" needs "model": the draft\'s HF '
                f"directory or .gguf file, got {self.model!r}"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f'speculative_config "model" is for method "draft_model", not {self.method!r}'
            )
        for name in ["num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(
                f"speculative_config disable_by_batch_size must be a positive integer or null, "
                f"got {size!r}"
            )
        cost = self.draft_token_cost
        if cost is not None and (
            not isinstance(cost, (int, float)) or isinstance(cost, bool) or not cost >= 0
        ):
            raise ValueError(
                f"speculative_config draft_token_cost must be a number >= 0 or null, got {cost!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must not "
                f"exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From None, a SpeculativeConfig, a dict of vLLM's keys, or that dict as JSON (the
        CLI's `--speculative-config '{...}'`); `{"method": "none"}` is no speculation (None)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(
                f'speculative_config must be a dict such as {{"method": "ngram", '
                f'"num_speculative_tokens": 4}}, got {value!r}'
            )
        options = dict(value)
        if options.get("method") == "none":
            # The off switch: spelled as a method so that it fits the CLI's one JSON option
            # and the Python keyword alike, and stays distinct from "unset" (None).
            if len(options) > 1:
                raise ValueError(
                    'speculative_config {"method": "none"} turns speculation off and takes no '
                    f"other keys, got {sorted(set(options) - {'method'})}"
                )
            return None
        if "model" in options:  # vLLM infers the method from a draft model
            options.setdefault("method", "draft_model")
        if "method" not in options:
            raise ValueError(
                'speculative_config needs a "method" ("ngram") or a draft "model" (a path)'
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of one engine. Pure Python; no torch import here."""

    model: str | None = _option(
        None, "HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    block_size: int = _option(16, "tokens per KV block")
    max_num_seqs: int = _option(256, "most sequences RUNNING at once")
    max_num_batched_tokens: int = _option(
        4096, "token budget of one step (decodes + prefill chunks)"
    )
    max_model_len: int | None = _option(
        None, "prompt + completion limit (default: the model's own)"
    )
    enable_prefix_caching: bool = _option(True, "reuse KV blocks of identical prompt prefixes")
    num_kv_blocks: int | None = _option(
        None, "KV pool size, overriding the memory budget (tiny pools force preemption)"
    )
    kv_cache_memory_gb: float | None = _option(
        None,
        "KV cache budget on the CPU, in GB (vLLM's kv_cache_memory_bytes; default: a "
        "quarter of the memory available after loading the weights, at most 2 GB)",
    )
    kv_cache_dtype: str = _option(
        "auto",
        "what the KV cache stores (vLLM's option): auto = the compute dtype, but bf16 where "
        "dtype is auto and the CPU computes in fp32 (no native bf16); bfloat16; int8 = int8 "
        "with a float32 scale per token and KV head (~2x the tokens in the same memory); "
        "fp8 = float8 e4m3, no scale; int8 and fp8 on the CPU and on CUDA with triton",
        KV_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = _option(
        0.9,
        "share of GPU memory the engine may use; the KV cache gets what the weights and a "
        "profiled largest step leave",
    )
    device: str | None = _option(
        None, "cpu or cuda (default: cuda when available)", ("cpu", "cuda")
    )
    dtype: str | None = _option(
        "auto",
        "compute dtype; auto: bfloat16 on CUDA and on CPUs with native bf16 "
        "(AVX-512 BF16), else float32; float32 is the token-exact path",
        ("auto", "float32", "bfloat16", "float16"),
    )
    seed: int = _option(0, "the engine's random seed (requests without their own seed)")
    tensor_parallel_size: int = _option(1, "processes the model is split over")
    quantization: str | None = _option(
        None,
        "weights: default = as stored (on the CPU a GGUF's 4-bit tensors run packed: "
        "torch's int4 kernel in bf16, ours in float32); int4: also quantize the other linear "
        "layers (HF checkpoints); int8: int8 MLP gate/up (CPU, float32); none: dense",
        ("int4", "int8", "none"),
    )
    enforce_eager: bool = _option(
        False,
        "run every step eagerly: skip compiling the decode step (torch.compile, done "
        "on the CPU at start-up for steps of up to 4 sequences, cached on disk) and, on "
        "CUDA, capturing its CUDA graphs",
    )
    generation_config: str = _option(
        "auto",
        "sampling defaults of requests that leave a field unset: auto (the model's "
        "generation_config.json, as vLLM), vllm (vLLM's neutral defaults) or a folder holding "
        "a generation_config.json",
    )
    speculative_config: SpeculativeConfig | None = _option(
        None,
        'speculative decoding, vLLM\'s shape as JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
        '(prompt lookup) or \'{"model": "draft.gguf", "num_speculative_tokens": 4}\' (a '
        "draft model with the target's vocabulary); greedy and sampled requests; "
        '\'{"method": "none"}\' (or --no-speculation) turns it off. Unset: on the CPU, '
        "n-gram drafts where the start-up measurement says they pay",
    )
    pooling: str | None = _option(
        None,
        "how embedding requests pool the final hidden states: last token, mean or cls "
        "(default: the model's sentence-transformers config, else last), L2-normalized",
        ("last", "mean", "cls"),
    )
    enable_lora: bool = _option(
        False,
        "serve LoRA adapters (PEFT folders or llama.cpp LoRA GGUFs) on top of the base "
        "weights, per request; steps run eagerly",
    )
    max_loras: int = _option(4, "most LoRA adapters resident at once (LRU eviction)")
    max_lora_rank: int = _option(64, "largest LoRA rank accepted")
    lora_modules: tuple[str, ...] = _option(
        (), "LoRA adapters served from start-up: name=path ... (a PEFT folder or a LoRA .gguf)"
    )
    # filled from the model when the engine is built
    eos_token_ids: tuple[int, ...] = _option((), "end-of-sequence token ids", cli=False)

    def __post_init__(self) -> None:
        positive = ["block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"]
        positive += ["max_loras", "max_lora_rank"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ["max_model_len", "num_kv_blocks"]:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder path, got "
                f"{self.generation_config!r}"
            )
        if self.quantization not in (None, "int4", "int8", "none"):
            raise ValueError(
                f"quantization must be None, 'int4', 'int8' or 'none', got {self.quantization!r}"
            )
        if self.pooling not in (None, "last", "mean", "cls"):
            raise ValueError(f"pooling must be 'last', 'mean' or 'cls', got {self.pooling!r}")
        # A dict or JSON string (the Python API's and the CLI's shape) becomes the frozen
        # SpeculativeConfig once, here, during construction.
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config with tensor_parallel_size > 1 is not supported yet"
            )

        modules = self.lora_modules or ()  # the CLI gives one string: "a=path b=path"
        modules = modules.replace(",", " ").split() if isinstance(modules, str) else modules
        object.__setattr__(self, "lora_modules", tuple(modules))
        for module in self.lora_modules:
            name, sep, path = str(module).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules entries are name=path, got {module!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported yet")

    @property
    def eager(self) -> bool:
        """Whether every step runs eagerly: asked for, or LoRA (its per-row grouping)."""
        return self.enforce_eager or self.enable_lora

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build a config from keyword options, rejecting unknown names with a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**options)  # type: ignore[arg-type]
