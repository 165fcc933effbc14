"""Length-grouped batching over a dataset's sample lengths (extraction and training both batch this way)."""
from __future__ import annotations

import numpy as np


def length_grouped_batches(lengths: np.ndarray, indices: np.ndarray, max_tokens: int,
                           rng: np.random.Generator | None) -> list[list[int]]:
    """Batches of similar lengths whose padded size (batch x longest) stays within max_tokens; a sample
    longer than max_tokens goes alone. With `rng`, equal lengths are tie-broken and batches ordered randomly."""
    jitter = rng.random(len(indices)) if rng is not None else np.zeros(len(indices))
    order = indices[np.lexsort((jitter, lengths[indices]))]
    batches, cur = [], []
    for i in order:
        longest = int(lengths[i])  # ascending, so the newest is the longest
        if cur and (len(cur) + 1) * longest > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(int(i))
    batches += [cur] if cur else []
    if rng is not None:
        batches = [batches[k] for k in rng.permutation(len(batches))]
    return batches
