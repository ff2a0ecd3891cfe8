"""Splitting a batch into groups of like sequences before the padded SDPA.

Padding costs work in proportion to `num_seqs * max_query_len * max_seq_len`, so a batch is
split into a few groups (decodes apart from prefills, then runs of similar lengths), one gather
and one SDPA call per group. Without it, one 256-token prefill chunk padded 15 decodes to 256
queries each (`benchmarks/attention_groups.py` measures it; see docs/benchmarks.md).
"""

# Fixed cost of one more group, in units of padded work (one query against one key): the
# extra gather, mask, index copies and SDPA call. Tuned with `benchmarks/attention_groups.py`
# on SmolLM2's shapes: the value at which splitting never lost to one group (the figures are
# in docs/benchmarks.md, "Batching, attention and the LM head").
GROUP_OVERHEAD = 512
MAX_GROUPS = 8


def partition_batch(
    query_lens: list[int], seq_lens: list[int], overhead: int = GROUP_OVERHEAD
) -> list[list[int]]:
    """Split a batch's sequences into groups that each pad little: decodes (one query) apart
    from prefill chunks, then, in order of length, split wherever the padded work saved
    (`n * max_query_len * max_seq_len` per group) exceeds `overhead`, at most MAX_GROUPS
    groups. Returns the sequence indices of each group (every index once)."""

    def cost(run: list[int]) -> int:
        return len(run) * max(query_lens[i] for i in run) * max(seq_lens[i] for i in run)

    def split(run: list[int]) -> list[list[int]]:
        best, best_at = cost(run) - overhead, 0
        q_suffix = [0] * (len(run) + 1)
        for j in range(len(run) - 1, -1, -1):
            q_suffix[j] = max(q_suffix[j + 1], query_lens[run[j]])
        q_prefix = 0
        for j in range(1, len(run)):
            q_prefix = max(q_prefix, query_lens[run[j - 1]])
            left = j * q_prefix * seq_lens[run[j - 1]]  # runs are sorted by seq_len
            right = (len(run) - j) * q_suffix[j] * seq_lens[run[-1]]
            if left + right < best:
                best, best_at = left + right, j
        if best_at == 0:
            return [run]
        return [run[:best_at], run[best_at:]]

    decodes = [i for i, q in enumerate(query_lens) if q == 1]
    prefills = [i for i, q in enumerate(query_lens) if q != 1]
    groups = [
        sorted(run, key=lambda i: (seq_lens[i], query_lens[i]))
        for run in (decodes, prefills)
        if run
    ]
    while len(groups) < MAX_GROUPS:
        gains = [(cost(g) - sum(cost(p) for p in split(g)), n) for n, g in enumerate(groups)]
        gain, n = max(gains)
        if gain <= overhead:
            break
        groups[n : n + 1] = split(groups[n])
    return groups
