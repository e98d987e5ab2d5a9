"""What every kernel module shares: the count of emulated calls by kind (what a run reached) and the arguments of
the calls they intercept, read in one place."""

from __future__ import annotations

from collections import Counter

from ...errors import HalfsafeError

calls: Counter = Counter()  # emulated calls by kind ("norm", "layer_norm", "linear", "attention", "activation")


def layer_norm_args(args, kwargs) -> tuple:
    """F.layer_norm's (x, weight, bias, eps), as called; one counted emulated call. The float16 emulation covers the
    last dim only."""
    shape = args[1]
    if len(shape) != 1:
        raise HalfsafeError(f"layer_norm over {len(shape)} dims: the float16 emulation covers the last dim only")
    calls["layer_norm"] += 1
    return (args[0], kwargs.get("weight", args[2] if len(args) > 2 else None),
            kwargs.get("bias", args[3] if len(args) > 3 else None), kwargs.get("eps", args[4] if len(args) > 4 else 1e-5))


def attention_inputs(module, key, value, scaling):
    """One counted emulated attention call: its scale (the module's 1/sqrt(head_dim) when not given) and key and
    value repeated for each query head of their group (grouped-query attention)."""
    calls["attention"] += 1
    if scaling is None:
        scaling = module.head_dim ** -0.5
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return scaling, key, value
