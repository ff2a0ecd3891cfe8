"""TPModelRunner: rank 0 of a tensor-parallel group; the engine's runner when
`tensor_parallel_size > 1`.

Rank 0 runs the scheduler and its own shard. Each step it broadcasts a `StepMessage` (the
flat model inputs, never Sequences) to ranks 1..k-1, then runs the same single-process
`ModelRunner.run` on its shard: the layers' collectives join the ranks' partial results, and
the LM head gathers the full logits on rank 0, the only rank that samples.

Lifecycle. On one machine the runner starts ranks 1..k-1 itself, as
`python -m minivllm.engine.tp_worker` processes meeting at a free loopback port. When
`WORLD_SIZE` and `RANK=0` are set in the environment (torch's `env://` variables, with
`MASTER_ADDR` and `MASTER_PORT`), it starts none and waits for ranks started by hand on other
machines. `close()` (also run when the runner is garbage-collected and at interpreter exit)
sends a `ShutdownMessage` and reaps the workers, killing any that do not leave in time. A
worker that dies or fails makes the next (or current) step raise a RuntimeError that names
it, after which the whole group is shut down: no step can run on a partial model.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minivllm.config import EngineConfig
from minivllm.distributed import parallel_state
from minivllm.distributed.heads import shard_heads
from minivllm.engine.device import resolve_device
from minivllm.engine.model_runner import ModelRunner, prepare_inputs
from minivllm.engine.runner_output import RunnerOutput
from minivllm.engine.scheduler import ScheduledBatch
from minivllm.engine.tp_messages import ShutdownMessage, StepMessage, send

logger = logging.getLogger(__name__)

# The directory holding the `minivllm` package, for the workers' PYTHONPATH (from this file's
# place rather than `import minivllm`, whose __init__ imports the engine that imports us).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_WAIT_S = 10.0  # how long workers get to leave after the shutdown message
WORKER_COMMAND = [sys.executable, "-m", "minivllm.engine.tp_worker"]
DEATH_NOTICE_S = 2.0  # after a failed collective, how long to wait for the dead worker to show


def check_split(hf_config: Any, tp_size: int) -> None:
    """ValueError unless the model splits over `tp_size` ranks: its heads (any layout with at
    least one query head per rank), its vocabulary and its MLP width."""
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    for rank in range(tp_size):
        shard_heads(num_heads, num_kv_heads, tp_size, rank)
    for name in ("vocab_size", "intermediate_size"):
        value = int(getattr(hf_config, name))
        if value % tp_size:
            raise ValueError(
                f"cannot split the model over tensor_parallel_size={tp_size}: its {name} "
                f"({value}) is not a multiple of it"
            )


class WorkerGroup:
    """The worker processes this rank started, and the control group's message counter.

    Holds no reference to the runner, so it can be the runner's finalizer.
    """

    def __init__(self, procs: dict[int, subprocess.Popen], error_dir: str | None) -> None:
        self.procs = procs  # rank -> process (empty when the ranks run elsewhere)
        self.error_dir = error_dir
        self.control: dist.ProcessGroup | None = None
        self.step = 0  # number of the last message sent
        self.closed = False
        self.healthy = True  # False once a step failed: no shutdown message then
        self.threads_before = torch.get_num_threads()

    def error_file(self, rank: int) -> str | None:
        return None if self.error_dir is None else os.path.join(self.error_dir, f"rank{rank}.txt")

    def dead(self) -> list[str]:
        """A description of each worker process that has exited."""
        found = []
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                continue
            how = (
                f"was killed by {signal.Signals(-code).name}"
                if code < 0
                else f"exited with code {code}"
            )
            line = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"
            path = self.error_file(rank)
            if path and os.path.exists(path):
                lines = Path(path).read_text().strip().splitlines()
                line += ": " + (lines[-1] if lines else "")
            found.append(line)
        return found

    def check_alive(self) -> None:
        """RuntimeError naming the dead workers, if any."""
        dead = self.dead()
        if dead:
            raise RuntimeError("; ".join(dead))

    def failure(self, exc: BaseException) -> RuntimeError:
        """The error to raise for `exc`, a failure in a step or in the start-up."""
        self.healthy = False
        deadline = time.monotonic() + (DEATH_NOTICE_S if self.procs else 0.0)
        dead = self.dead()
        while not dead and time.monotonic() < deadline:  # its socket closes just before it exits
            time.sleep(0.02)
            dead = self.dead()
        what = "; ".join(dead) if dead else f"tensor-parallel step failed: {exc!r}"
        return RuntimeError(f"{what}; the tensor-parallel engine has shut down")

    def shutdown(self) -> None:
        """Tell the workers to leave, reap them (killing stragglers), leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.control is not None and self.healthy:
            try:
                self.step += 1
                send(ShutdownMessage(self.step), self.control)
            except Exception:  # a worker already gone: reaped below either way
                logger.debug("shutdown message not delivered", exc_info=True)
        deadline = time.monotonic() + (SHUTDOWN_WAIT_S if self.healthy else 0.0)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        parallel_state.destroy()
        if self.error_dir is not None:
            shutil.rmtree(self.error_dir, ignore_errors=True)
        torch.set_num_threads(self.threads_before)


def _start_local_workers(world_size: int, port: int, device_type: str) -> WorkerGroup:
    """Ranks 1..world_size-1 as child processes of this one, on this machine."""
    error_dir = tempfile.mkdtemp(prefix="minivllm-tp-")
    group = WorkerGroup({}, error_dir)
    package_root = str(PACKAGE_ROOT)
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    for rank in range(1, world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "PYTHONPATH": python_path,
        }
        command = [
            *WORKER_COMMAND,
            "--device",
            device_type,
            "--error-file",
            str(group.error_file(rank)),
            "--parent-pid",
            str(os.getpid()),
        ]
        group.procs[rank] = subprocess.Popen(command, env=env)
    return group


def _rendezvous_address(world_size: int) -> tuple[str, int] | None:
    """MASTER_ADDR/MASTER_PORT when the ranks were started by hand (WORLD_SIZE, RANK set)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    if os.environ["RANK"] != "0":
        raise ValueError(
            f"the engine is rank 0, but RANK={os.environ['RANK']}: start the other ranks with "
            "`python -m minivllm.engine.tp_worker`"
        )
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size={world_size}"
        )
    if "MASTER_PORT" not in os.environ:
        raise ValueError("set MASTER_PORT (and MASTER_ADDR) for a multi-machine engine")
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])


class TPModelRunner:
    """The engine's runner over `config.tensor_parallel_size` ranks; this process is rank 0.

    Same interface as ModelRunner (`num_kv_blocks`, `vocab_size`, `run`), plus `close()`.
    """

    def __init__(self, config: EngineConfig, model_dir: Path, hf_config: Any) -> None:
        world_size = config.tensor_parallel_size
        check_split(hf_config, world_size)  # a bad split fails before any process starts
        self.config = config
        self.model_dir = model_dir
        self.device = resolve_device(config)
        self.block_size = config.block_size
        address = _rendezvous_address(world_size)
        if address is None:
            if self.device.type == "cuda" and world_size > torch.cuda.device_count():
                # Each local rank takes its own GPU: a missing one would kill that rank's
                # process at start-up with CUDA's "invalid device ordinal".
                raise ValueError(
                    f"tensor_parallel_size={world_size} on CUDA needs {world_size} GPUs, one a "
                    f"rank; torch sees {torch.cuda.device_count()}: pass a smaller "
                    "tensor_parallel_size, or device='cpu'"
                )
            address = ("127.0.0.1", parallel_state.free_loopback_port())
            self._workers = _start_local_workers(world_size, address[1], self.device.type)
            torch.set_num_threads(parallel_state.threads_per_rank(world_size))
        else:
            self._workers = WorkerGroup({}, None)
        self._finalizer = weakref.finalize(self, self._workers.shutdown)
        try:
            self._workers.control = parallel_state.rendezvous(
                0, world_size, *address, self.device.type, self._workers.check_alive
            )
            dist.broadcast_object_list(
                [(config, str(model_dir))], src=0, group=self._workers.control
            )
            self._runner = ModelRunner(config, model_dir, hf_config, tp_rank=0, tp_size=world_size)
        except Exception as exc:
            error = self._workers.failure(exc)
            self.close()
            raise error from exc
        self.num_kv_blocks = self._runner.num_kv_blocks
        self.vocab_size = self._runner.vocab_size
        self._failure: RuntimeError | None = None

    def run(self, batch: ScheduledBatch, token_bitmask: Any = None) -> RunnerOutput:
        """One step on every rank; rank 0 samples (within `token_bitmask`, as
        ModelRunner.run). RuntimeError if a rank has failed."""
        if self._failure is not None:
            raise RuntimeError(str(self._failure))
        if self._workers.closed:
            raise RuntimeError("the tensor-parallel engine is closed")
        workers = self._workers
        try:
            workers.check_alive()
            # The same pure function ModelRunner.run applies to the plan: identical inputs.
            inputs = prepare_inputs(batch, self.block_size, self.device)
            meta = inputs.meta
            workers.step += 1
            send(
                StepMessage(
                    workers.step,
                    inputs.input_ids,
                    inputs.positions,
                    meta.slot_mapping,
                    meta.query_start_loc,
                    meta.seq_lens,
                    meta.block_tables,
                    inputs.logits_indices,
                ),
                workers.control,
            )
            return self._runner.run(batch, token_bitmask)
        except Exception as exc:
            self._failure = workers.failure(exc)
            self.close()
            raise self._failure from exc

    def close(self) -> None:
        """Shut the workers down and leave the process group (idempotent)."""
        self._finalizer()
