"""The tensor-parallel process group: rendezvous of the ranks, and the collectives.

Every rank meets at a `torch.distributed.TCPStore` served by rank 0 at
`MASTER_ADDR:MASTER_PORT` (the variables of torch's `env://` initialisation), then joins two
groups:

- the default group (gloo on the CPU, NCCL on CUDA), for the model's collectives: the layers
  call `all_reduce` and `gather_to_first` below, on tensors of the model's device;
- a control group (always gloo, CPU tensors), for rank 0's per-step messages. Workers wait
  on it between steps for as long as the engine is idle, so its timeout is very long, while
  the model group's timeout is what turns a hung rank into an error.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a model collective (or the rendezvous) waits this
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits this long for rank 0's next message
_STORE_PREFIX = "minivllm"


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_per_rank(local_world_size: int) -> int:
    """Intra-op threads for one of `local_world_size` ranks sharing this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def rendezvous(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device_type: str,
    check_peers: Callable[[], None] | None = None,
) -> dist.ProcessGroup:
    """Join the tensor-parallel group; return the control group.

    Rank 0 serves the store and waits until every other rank has checked in, calling
    `check_peers` (which raises if a worker it started has died) while it waits, so a worker
    that fails before the rendezvous is an error at once rather than after the timeout.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process; close() the previous one first"
        )
    store = dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,
    )
    if rank == 0:
        keys = [f"ready/{r}" for r in range(1, world_size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while keys and not store.check(keys):
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rendezvous at {master_addr}:{master_port} timed out: "
                    f"not every one of the {world_size - 1} worker rank(s) joined"
                )
            time.sleep(0.02)
    else:
        store.set(f"ready/{rank}", "1")
    dist.init_process_group(
        backend_for(device_type),
        store=dist.PrefixStore(_STORE_PREFIX, store),
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def destroy() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns `x`."""
    dist.all_reduce(x)
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (e.g. the KV block count every rank can hold)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_to_first(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim on rank 0; other ranks get `x` back.

    `[N, V / k]` on each rank -> `[N, V]` on rank 0 (the LM head: only rank 0 samples).
    """
    x = x.contiguous()
    if dist.get_rank() != 0:
        dist.gather(x, None, dst=0)
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1)  # [N, V]
