"""`export onnx --runtime P` for a P whose linear layers accumulate in float16 (`matmul_chunk`): the head's dot
products split into `HEAD_GROUPS` matrix products over consecutive runs of K, added pairwise.

A float16 running sum rounds at the size of its partial sums once per run of `matmul_chunk` k, so its error grows
with the number of runs. The head is where that costs most: its outputs are the logits, compared across a whole
vocabulary, and its K (the hidden size) is summed in one running sum. x W^T = sum_g x[:, K_g] W[:, K_g]^T holds exactly
in real arithmetic, so the graph computes the same function; each group's running sum is a quarter as long, and the
four partial logits meet in a two-level float16 tree. Measured on Gemma 3 270M under the profile's emulation
(docs/results.md): KL 7.6e-05 -> 5.3e-05. The weight is sliced inside the graph (a tied head keeps one stored matrix).
"""

from __future__ import annotations

from torch import nn

from ..runtime.profiles import RuntimeProfile

HEAD_GROUPS = 4


def _grouped_forward(head: nn.Linear, groups: int):
    k = head.weight.shape[1]
    bounds = [k * g // groups for g in range(groups + 1)]

    def forward(x):
        parts = [x[..., a:b] @ head.weight[:, a:b].t() for a, b in zip(bounds, bounds[1:])]
        while len(parts) > 1:  # pairwise: each level one float16 add per logit
            parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
        return parts[0] if head.bias is None else parts[0] + head.bias

    return forward


def split_head_(model: nn.Module, profile: RuntimeProfile, groups: int = HEAD_GROUPS) -> int:
    """Give `model`'s output head the grouped forward (in place, before export) when `profile` accumulates linear
    layers in float16 (as many groups as the head's K holds runs, at most `groups`); returns the number of groups
    (1: unchanged)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chunk = profile.matmul_chunk
    if not profile.accumulates_fp16 or chunk is None or not isinstance(head, nn.Linear):
        return 1
    groups = min(groups, head.weight.shape[1] // chunk)
    if groups < 2:
        return 1
    head.forward = _grouped_forward(head, groups)
    return groups
