"""Tensor parallelism over `torch.distributed`: gloo on the CPU, NCCL on CUDA.

- `heads`: which attention heads (and so which KV heads) each rank holds.
- `parallel_state`: the rendezvous of the ranks and the collectives the layers call.
- `messages`: the typed per-step message rank 0 broadcasts to the other ranks.
- `worker`: the loop of ranks 1..k-1 (also the command that starts a rank on another machine).
- `tp_runner`: `TPModelRunner`, rank 0's runner, which starts, drives and stops the workers.

Nothing here is imported by the single-process engine unless `tensor_parallel_size > 1`,
except `heads` and `parallel_state`, which the layers use and which import no engine code.
"""
