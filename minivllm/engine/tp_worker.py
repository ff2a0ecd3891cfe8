"""A tensor-parallel worker: ranks 1..k-1, each holding its shard of the model and KV cache.

It joins the group, receives the engine config from rank 0, loads its shard, then runs one
step per `StepMessage` until a `ShutdownMessage`. It never samples: rank 0 does.

The engine starts local workers itself. On other machines start each rank by hand, with
torch's `env://` variables (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, optionally
`LOCAL_RANK` for the GPU and `LOCAL_WORLD_SIZE` for the CPU thread share):

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 python -m minivllm.engine.tp_worker
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minivllm.distributed import parallel_state
from minivllm.engine.logits import compute_logits_in_slices
from minivllm.engine.tp_messages import ShutdownMessage, StepMessage, receive

if TYPE_CHECKING:
    from minivllm.engine.model_runner import ModelRunner

PARENT_POLL_S = 1.0  # how often a worker the engine started checks that the engine lives


def run_step(runner: ModelRunner, message: StepMessage) -> None:
    """This rank's part of one step: the same forward and LM-head calls as rank 0's
    ModelRunner.run, so every collective meets its peers; the logits are rank 0's."""
    device = runner.device
    meta = message.attention_metadata(runner.block_size, device)
    input_ids, positions = message.input_ids.to(device), message.positions.to(device)
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)  # [T, hidden_size]
    for _ in compute_logits_in_slices(runner.model, hidden, message.logits_indices.to(device)):
        pass  # the same LM-head calls as rank 0's; the logits are rank 0's


def serve(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device_type: str,
    local_rank: int,
    model_dir_override: str | None = None,
) -> None:
    """Join the group, load this rank's shard, and run steps until told to shut down."""
    from transformers import AutoConfig

    from minivllm.engine.model_runner import ModelRunner

    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    control = parallel_state.rendezvous(rank, world_size, master_addr, master_port, device_type)
    try:
        received: list[object] = [None]
        dist.broadcast_object_list(received, src=0, group=control)
        config, model_dir = received[0]  # type: ignore[misc]
        model_dir = Path(model_dir_override) if model_dir_override else Path(model_dir)
        hf_config = AutoConfig.from_pretrained(model_dir)
        runner = ModelRunner(config, model_dir, hf_config, tp_rank=rank, tp_size=world_size)
        step = 0
        with torch.inference_mode():
            while True:
                message = receive(control, step + 1)
                if isinstance(message, ShutdownMessage):
                    return
                step = message.step
                run_step(runner, message)
    finally:
        parallel_state.destroy()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker the engine started dies with it, even if the engine was killed."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise SystemExit(f"minivllm worker: set {name} (torch.distributed env:// variables)")
        return default
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minivllm.engine.tp_worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="must match the engine's device (default: cuda when available)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="the model directory on this machine, if not at rank 0's path",
    )
    parser.add_argument("--error-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.parent_pid is not None:  # started by the engine: it owns Ctrl-C and our lifetime
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid,), daemon=True).start()
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    master_addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    master_port = _env_int("MASTER_PORT")
    local_rank = _env_int("LOCAL_RANK", 0)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(parallel_state.threads_per_rank(_env_int("LOCAL_WORLD_SIZE", 1)))
    try:
        serve(rank, world_size, master_addr, master_port, device_type, local_rank, args.model_dir)
    except BaseException:
        if args.error_file:
            Path(args.error_file).write_text(traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
