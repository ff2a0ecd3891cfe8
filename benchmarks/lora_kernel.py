"""The LoRA update of one layer, two ways: the masked matmuls over every resident adapter
against our grouped kernel (`minivllm::lora_rows`, each row through its own adapter), at the
default model's shapes, four adapters, rows spread evenly over them; microseconds of CPU time
per call (time.process_time: a shared machine's stolen time does not count) on one thread.

    PYTHONPATH=$PWD python benchmarks/lora_kernel.py [--rows 16 64] [--rank 16]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from minivllm.layers.cpu_kernels import cpu_kernels_available

# (inputs, shards, outputs) of SmolLM2-135M's qkv, gate_up and down projections
SHAPES = {"qkv": (576, 3, 960), "gate_up": (576, 2, 3072), "down": (1536, 1, 576)}


def cpu_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def _masked(x, out, a, b, mask) -> torch.Tensor:  # noqa: ANN001
    return torch.addmm(out, (x @ a.T).mul_(mask), b.T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("minivllm's CPU kernels do not run here")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    s = args.adapters
    for n in args.rows:
        for name, (inputs, shards, outputs) in SHAPES.items():
            r = args.rank * shards
            x = torch.randn(n, inputs, dtype=torch.bfloat16)
            out = torch.randn(n, outputs, dtype=torch.bfloat16)
            a = torch.randn(s * r, inputs, dtype=torch.bfloat16)
            b = torch.randn(outputs, s * r, dtype=torch.bfloat16)
            slot = torch.arange(n) % s
            mask = (slot[:, None] == (torch.arange(s * r) // r)[None]).to(torch.bfloat16)
            a_k = a.float().view(s, r, inputs).contiguous()
            b_k = b.float().T.reshape(s, r, outputs).contiguous()
            order = torch.argsort(slot, stable=True)
            starts = torch.tensor([0] + [int((slot <= i).sum()) for i in range(s)])

            masked = partial(_masked, x, out, a, b, mask)
            grouped = partial(
                torch.ops.minivllm.lora_rows, x, out, order, starts, torch.arange(s), a_k, b_k
            )

            print(
                f"{n:4d} rows {name:8s} masked {cpu_us(masked):7.0f} us   "
                f"grouped kernel {cpu_us(grouped):7.0f} us"
            )


if __name__ == "__main__":
    main()
