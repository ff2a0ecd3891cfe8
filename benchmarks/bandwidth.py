"""The memory-bandwidth ceiling of one-stream decoding: a STREAM-like triad, and what it allows
a GGUF model.

    .venv/bin/python benchmarks/bandwidth.py [--threads 1 2] [--mib 512] [--model FILE ...]
        [--tok-s NAME=RATE ...]

A one-stream decode step reads every weight once (the embedding table excepted: one row of it,
unless the head is tied to it and reads it whole), so tok/s <= bandwidth / bytes read per
token. The triad (`a = b + s * c` over float32 arrays much larger than the caches, STREAM's
kernel and its count: 12 bytes an element, reads and the write, no write-allocate) measures the
bandwidth per thread count; best of `--rounds`. With `--model` the script prints the bytes a
token reads and the tok/s ceiling at each thread count; with `--tok-s name=rate` (a measured
one-stream rate, e.g. ours=24.0 llama=27.4) it prints each rate as a share of that ceiling at
the largest thread count.
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGUFReader


def triad_gbps(mib: int, threads: int, rounds: int) -> float:
    """STREAM triad GB/s (1e9 bytes) over three float32 arrays of `mib` MiB each."""
    torch.set_num_threads(threads)
    n = mib * 2**20 // 4
    b = torch.rand(n)
    c = torch.rand(n)
    a = torch.empty(n)
    torch.add(b, c, alpha=3.0, out=a)  # fault the pages in before timing
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return 12 * n / best / 1e9


def bytes_per_token(path: str) -> tuple[int, int]:
    """(bytes a one-stream decode step reads, file's tensor bytes) for a GGUF: every tensor
    once, the token embedding only as one row unless no separate output head exists (tied:
    the head reads the whole table)."""
    reader = GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) for t in reader.tensors}  # gguf lists dims innermost first
    total = sum(sizes.values())
    read = total
    if "output.weight" in sizes and "token_embd.weight" in sizes:
        read -= sizes["token_embd.weight"] - sizes["token_embd.weight"] // rows["token_embd.weight"]
    return read, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--mib", type=int, default=512, help="size of each of the 3 arrays")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--model", nargs="*", default=[], help="GGUF files")
    parser.add_argument("--tok-s", nargs="*", default=[], help="name=rate, one-stream tok/s")
    args = parser.parse_args()

    bandwidth = {t: triad_gbps(args.mib, t, args.rounds) for t in args.threads}
    for threads, gbps in bandwidth.items():
        print(f"triad  threads {threads:2d}  {gbps:6.1f} GB/s")
    top = bandwidth[max(bandwidth)]
    rates = {name: float(rate) for name, rate in (item.split("=", 1) for item in args.tok_s)}
    for path in args.model:
        read, total = bytes_per_token(path)
        ceilings = "  ".join(f"{t} threads {g * 1e9 / read:6.1f}" for t, g in bandwidth.items())
        print(f"{path}: {read / 1e6:.1f} MB read a token ({total / 1e6:.1f} MB of tensors)")
        print(f"  ceiling tok/s: {ceilings}")
        for name, rate in rates.items():
            gbps = rate * read / 1e9
            print(
                f"  {name}: {rate:.1f} tok/s reads {gbps:.1f} GB/s, {gbps / top:.0%} of the triad"
            )
    if rates and not args.model:
        print("--tok-s needs --model (the bytes a token reads)")


if __name__ == "__main__":
    main()
