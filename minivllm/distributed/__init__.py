"""Tensor parallelism's ground floor, over `torch.distributed` (gloo on the CPU, NCCL on CUDA):

- `heads`: which attention heads (and so which KV heads) each rank holds.
- `parallel_state`: the rendezvous of the ranks and the collectives the layers call.

Both import nothing from the rest of the package, so the layers may use them. The executor that
drives the ranks sits beside the runner, in `minivllm/engine/`: `tp_runner` (rank 0's runner),
`tp_worker` (ranks 1..k-1) and `tp_messages` (the per-step message between them).
"""
