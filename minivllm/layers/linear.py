"""Linear layers, column- and row-parallel for tensor parallelism.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's part of a checkpoint tensor into it:

- `ColumnParallelLinear` splits the output dim (dim 0 of the weight and the bias) across ranks;
  `MergedColumnParallelLinear` (gate_up_proj) and `QKVParallelLinear` (qkv_proj) are column-parallel
  layers made of several checkpoint tensors ("shards") stacked along the output dim.
- `RowParallelLinear` splits the input dim (dim 1 of the weight); each rank's partial output
  is summed over the ranks by an all-reduce, and its bias (not split) is added once, by rank 0.

A rank's slice is `[tp_rank * size, (tp_rank + 1) * size)` unless a layer is given an explicit
`shard=(offset, size)`: attention heads split in whole KV groups can be uneven
(`minivllm.distributed.heads`), and so are the q/k/v and o_proj slices that follow them.

How a layer's weight runs (dense, int8, 4-bit kernels, a GGUF's stored blocks) is its `method`
(`minivllm.layers.quantization.methods`), chosen once at load by `minivllm.engine.weight_policy`.
"""

from typing import Any

import torch
from torch import nn

from minivllm.distributed import parallel_state
from minivllm.distributed.heads import shard_heads
from minivllm.layers.quantization.methods import LinearMethod, UnquantizedMethod


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Refuse a checkpoint tensor whose (full, unsplit) shape is not `expected`."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch: expected {tuple(expected)}, got {tuple(loaded.shape)}")


def _load_fused(
    load_shard: Any, param: nn.Parameter, loaded: torch.Tensor, sizes: dict[Any, int]
) -> None:
    """Split a checkpoint tensor that stores several shards stacked along dim 0 (`sizes`: shard
    id -> rows, in order) and load each through `load_shard(param, part, shard_id)`."""
    _check_shape(loaded, (sum(sizes.values()), *loaded.shape[1:]))
    start = 0
    for shard_id, rows in sizes.items():
        load_shard(param, loaded.narrow(0, start, rows), shard_id)
        start += rows


class LinearBase(nn.Module):
    """`y = x @ weight.T + bias`; weight is `[out_size_per_partition, in_size_per_partition]`.

    `tp_dim` is the weight dim split across ranks (0: output, 1: input, None: replicated);
    `shard = (offset, size)` is this rank's slice of it, by default the `tp_rank`-th of
    `tp_size` equal ones.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_dim: int | None,
        tp_size: int = 1,
        tp_rank: int = 0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.input_size = input_size
        self.output_size = output_size
        if shard is None and tp_dim is not None:
            full = (output_size, input_size)[tp_dim]
            size = _divide(full, tp_size, ("output_size", "input_size")[tp_dim])
            shard = (tp_rank * size, size)
        self.shard_offset, self.shard_size = shard or (0, 0)
        in_part = self.shard_size if tp_dim == 1 else input_size
        out_part = self.shard_size if tp_dim == 0 else output_size
        self.weight = nn.Parameter(torch.empty(out_part, in_part), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_part), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # how the weight runs: dense until the weight policy picks another at load
        self.method: LinearMethod = UnquantizedMethod()
        self.lora: Any = None  # a LoRALinear (minivllm.layers.lora) when adapters are enabled

    @property
    def shard_ids(self) -> tuple[int | str | None, ...]:
        """The checkpoint tensors stacked along the output dim, in order (None: one, whole)."""
        return (None,)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Load a whole (unfused) checkpoint tensor; fused layers override this for shards."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}")
        dim = self.tp_dim
        if dim is None or dim >= param.dim():  # replicated, or the bias of a row-parallel layer
            _check_shape(loaded, param.shape)
            param.data.copy_(loaded)
            return
        full_shape = list(param.shape)
        full_shape[dim] = (self.output_size, self.input_size)[dim]
        _check_shape(loaded, tuple(full_shape))
        param.data.copy_(loaded.narrow(dim, self.shard_offset, self.shard_size))

    def set_method(self, method: LinearMethod) -> None:
        """Run the weight with `method` from now on (its `create_weights` runs here; its
        `process_weights_after_loading` once the checkpoint is loaded)."""
        method.create_weights(self)
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp_dim={self.tp_dim}, tp_size={self.tp_size}, method={self.method.name}"
        )


class ReplicatedLinear(LinearBase):
    """A linear layer held whole by every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias, tp_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; each rank produces its slice of the output features."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, tp_dim=0, tp_size=tp_size, tp_rank=tp_rank, shard=shard
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    Shard `i` of the checkpoint (e.g. 0 = gate_proj, 1 = up_proj) has `output_sizes[i]` rows;
    each rank stores its slice of every shard, shard after shard.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_size=tp_size, tp_rank=tp_rank)

    @property
    def shard_ids(self) -> tuple[int | str | None, ...]:
        return tuple(range(len(self.output_sizes)))

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Load one shard, or with `shard_id=None` a checkpoint that stores them fused (Phi-3)."""
        if shard_id is None:
            _load_fused(self.weight_loader, param, loaded, dict(enumerate(self.output_sizes)))
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id must be in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        size = _divide(self.output_sizes[shard_id], self.tp_size, f"output shard {shard_id}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused: output is `[q (H*D) | k (KVH*D) | v (KVH*D)]` per rank.

    Each rank holds the query heads of `shard_heads` and the KV heads they read: split when
    there are at least tp_size KV heads, replicated otherwise (see `minivllm.distributed.heads`).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.head_dim = head_dim
        self.heads = shard_heads(num_heads, num_kv_heads, tp_size, tp_rank)
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        # Fused rows per rank: [q | k | v] of its own heads (the offset is unused: own loader).
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(
            hidden_size, output_size, bias, tp_size=tp_size, tp_rank=tp_rank, shard=(0, rows)
        )

    @property
    def shard_ids(self) -> tuple[int | str | None, ...]:
        return ("q", "k", "v")

    @property
    def q_size(self) -> int:
        """Width of this rank's q part of the output."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of this rank's k part (and of its v part) of the output."""
        return self.num_kv_heads * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Load q, k or v, or with `shard_id=None` a checkpoint's fused `[q | k | v]` (Phi-3)."""
        d = self.head_dim
        if shard_id is None:
            sizes = {
                "q": self.total_num_heads * d,
                "k": self.total_num_kv_heads * d,
                "v": self.total_num_kv_heads * d,
            }
            _load_fused(self.weight_loader, param, loaded, sizes)
            return
        # shard id -> (rows in this rank's fused output, first row in the checkpoint, its rows)
        offsets = {
            "q": (0, self.heads.q_start * d, self.total_num_heads * d),
            "k": (self.q_size, self.heads.kv_start * d, self.total_num_kv_heads * d),
            "v": (self.q_size + self.kv_size, self.heads.kv_start * d, self.total_num_kv_heads * d),
        }
        if shard_id not in offsets:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, start, full = offsets[shard_id]
        size = self.q_size if shard_id == "q" else self.kv_size
        _check_shape(loaded, (full, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; the partial outputs are summed by an all-reduce.

    `shard = (offset, size)` of the input features, when the split is uneven (o_proj follows
    the attention heads of its rank).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, tp_dim=1, tp_size=tp_size, tp_rank=tp_rank, shard=shard
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        # The bias is whole on every rank: only rank 0 adds it, so the sum has it once.
        out = self.method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return parallel_state.all_reduce(out)
