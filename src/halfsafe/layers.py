"""Finding a model's repeated blocks (decoder layers, T5 blocks, BERT layers) without per-family code."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the repeated blocks: the elements of each outermost ModuleList whose items share a
    class (excludes T5's mixed per-block `layer` list; MoE expert lists sit inside blocks)."""
    blocks: list[str] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(t + ".") for t in taken):
            continue
        if len({type(m) for m in module}) != 1:
            continue
        taken.append(name)
        blocks.extend(f"{name}.{i}" for i in range(len(module)))
    return blocks
