"""Probe a shrunken random copy of a model instead of the model itself.

What the probe measures (which activations each group moves, and by what power) depends on the architecture,
not on the weights: a random model of the same class and config, with small widths and only as many blocks as it
takes to hold one of every *kind* of block the real model has, gives the same answer, block kind by block kind.
`probe_governed` builds that model (`shrunk_model`), probes it, and maps its result onto the real model's groups:
each real block takes the result of the shrunk block of the same kind, site names renamed to the real block (and
a real expert to the shrunk expert it stands for). The real model is never run, so this costs the same for a 27B
as for a 270M.

A block's *kind* is read from the modules themselves (`block_signature`): every submodule's relative name and
class, and its flag-like attributes (bools and strings: `is_sliding`, `layer_type`, `is_kv_shared_layer`,
`store_full_length_kv`, ...); a dense and an MoE block differ by their MLP's class. Where the family has groups
spanning two blocks (`{i+1}`), consecutive pairs of kinds must be covered too.

The widths to shrink are data (`WIDTHS` and the tables below it, and each family's `shrink_widths`). A config that cannot be shrunk consistently
fails `shrunk_config` with one line naming the field; `probe_governed` then probes the real model as before and
logs why.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..errors import UnsupportedModelError
from ..families import REGISTRY, Family
from .groups import Group, expand
from .probe import probe
from .sites import Site, block_of, find_blocks
from .stats import is_fused_experts
from .threads import one_thread

log = logging.getLogger(__name__)

# Config field -> the size it is shrunk to (never grown: a field already smaller keeps its value). The widths every
# family shares; a family's own (multi-head latent attention, experts, per-layer inputs) are in its data
# (`Family.shrink_widths`), merged over these by `widths_of`.
WIDTHS = {
    # model width
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "out_hidden_size": 32,
    # MLP widths
    "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64, "n_inner": 64,
    # attention
    "num_attention_heads": 2, "n_head": 2, "num_heads": 2, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "head_dim": 16, "d_kv": 16,
}
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
KV_HEAD_FIELDS = ("num_key_value_heads", "num_global_key_value_heads", "multi_query_group_num")
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")  # how many experts: top-k is kept <= it
TOP_K_FIELDS = ("num_experts_per_tok", "top_k_experts", "experts_per_token")
WIDTH_FIELDS = ("hidden_size", "n_embd", "d_model")
# Block counts: cut to the first L-1 blocks and the last one; the per-block lists, block-index lists and
# block-keyed dicts are cut with them.
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers", "num_decoder_layers", "depth")
PER_LAYER_LISTS = ("layer_types",)
INDEX_LISTS = ("mlp_only_layers", "fullatt_block_indexes")
LAYER_DICTS = ("per_layer_config",)
FROM_END_FIELDS = ("num_kv_shared_layers",)  # counted from the last block: scaled with the cut
MAX_BLOCKS = 48  # the most blocks per list a shrunk model may need to hold every block kind


def _shrink(value, target: int) -> int:
    return min(value, target) if isinstance(value, int) and not isinstance(value, bool) else value


def widths_of(family: Family | None) -> dict[str, int]:
    """Config field -> shrunk size for a model of `family`: the shared `WIDTHS`, and the family's own over them."""
    return {**WIDTHS, **(family.shrink_widths if family is not None else {})}


def _shrink_dict(d: dict, layers: int, path: str, widths: dict[str, int]) -> dict:
    d = dict(d)
    for k, v in list(d.items()):
        if isinstance(v, dict) and "model_type" in v:  # a sub-config (text, vision, audio, encoder, decoder)
            d[k] = _shrink_dict(v, layers, f"{path}{k}.", widths)
    heads_before = {f: d[f] for f in HEAD_FIELDS if isinstance(d.get(f), int)}
    for f, target in widths.items():
        if f in d:
            d[f] = _shrink(d[f], target)
    for f in KV_HEAD_FIELDS:
        kv = d.get(f)
        if not isinstance(kv, int) or not heads_before:
            continue
        heads, now = next(iter(heads_before.values())), next(d[h] for h in heads_before)
        if heads % kv:
            raise UnsupportedModelError(f"cannot shrink {path}{f}={kv}: it does not divide {heads} heads")
        d[f] = max(1, now // (heads // kv))  # keeps MHA, GQA and MQA what they are
    for f in TOP_K_FIELDS:
        experts = [d[e] for e in EXPERT_FIELDS if isinstance(d.get(e), int)]
        if isinstance(d.get(f), int) and experts:
            d[f] = min(d[f], experts[0])
    n_layers = {f: d[f] for f in LAYER_FIELDS if isinstance(d.get(f), int)}
    for f, n in n_layers.items():
        d[f] = min(n, layers)
    if n_layers:
        before, after = max(n_layers.values()), max(d[f] for f in n_layers)
        # the cut keeps the first after-1 blocks and the last one (so the last block stays what it is)
        origin = list(range(after - 1)) + [before - 1] if after < before else list(range(before))
        for f in PER_LAYER_LISTS:
            if isinstance(d.get(f), list) and len(d[f]) == before:
                d[f] = [d[f][o] for o in origin]
        for f in INDEX_LISTS:
            if isinstance(d.get(f), list):
                d[f] = [i for i, o in enumerate(origin) if o in d[f]]
        for f in FROM_END_FIELDS:
            if isinstance(d.get(f), int) and d[f] and after < before:
                d[f] = max(1, min(after - 1, round(d[f] * after / before)))
        for f in LAYER_DICTS:  # per-block overrides: cut, and their widths shrunk as the config's
            if isinstance(d.get(f), dict):
                over = {int(k): v for k, v in d[f].items()}
                d[f] = {i: _shrink_overrides(over[o], heads_before, d, widths) for i, o in enumerate(origin) if o in over}
        if "attention_types" in d and after < before:  # GPT-Neo: [[pattern, repeats]] must cover the blocks exactly
            (pattern, _), *rest = d["attention_types"]
            if rest or after % len(pattern):
                raise UnsupportedModelError(f"cannot shrink {path}attention_types={d['attention_types']} to {after} blocks")
            d["attention_types"] = [[pattern, after // len(pattern)]]
            d.pop("attention_layers", None)
    _fix_rope(d, path)
    _check(d, path)
    return d


def _shrink_overrides(over, heads_before: dict, d: dict, widths: dict[str, int]):
    if not isinstance(over, dict):
        return over
    over = dict(over)
    if isinstance(over.get("head_dim"), int):  # the wider heads of the blocks overridden (Gemma 4's global attention)
        over["head_dim"] = min(over["head_dim"], widths.get("global_head_dim", widths["head_dim"]))
    kv = over.get("num_key_value_heads")
    if isinstance(kv, int) and heads_before:
        heads, now = next(iter(heads_before.values())), next(d[h] for h in heads_before)
        over["num_key_value_heads"] = max(1, now // max(1, heads // kv))
    return over


def _head_dim(d: dict) -> int | None:
    if isinstance(d.get("head_dim"), int):
        return d["head_dim"]
    width = next((d[f] for f in WIDTH_FIELDS if isinstance(d.get(f), int)), None)
    heads = next((d[f] for f in HEAD_FIELDS if isinstance(d.get(f), int)), None)
    return width // heads if width and heads else None


def _fix_rope(d: dict, path: str) -> None:
    """RoPE tables sized by the head: longrope's per-frequency factors, M-RoPE's sections."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if not isinstance(rope, dict):
            continue
        rope = d[key] = dict(rope)
        head = _head_dim(d)
        rotary = int(head * rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) if head else None
        for f in ("short_factor", "long_factor"):
            if isinstance(rope.get(f), list) and rotary:
                rope[f] = rope[f][: rotary // 2]
        sections = rope.get("mrope_section")
        if isinstance(sections, list) and rotary and sum(sections) != rotary // 2:
            total, half = sum(sections), rotary // 2
            new = [max(1, s * half // total) for s in sections]
            new[-1] += half - sum(new)
            if new[-1] < 1:
                raise UnsupportedModelError(f"cannot shrink {path}{key}.mrope_section={sections} to {half} frequencies")
            rope["mrope_section"] = new


def _check(d: dict, path: str) -> None:
    """Widths that must stay consistent after shrinking; one line naming the field otherwise."""
    heads = next(((f, d[f]) for f in HEAD_FIELDS if isinstance(d.get(f), int)), None)
    width = next(((f, d[f]) for f in WIDTH_FIELDS if isinstance(d.get(f), int)), None)
    if heads and width and not isinstance(d.get("head_dim"), int) and not isinstance(d.get("d_kv"), int) and width[1] % heads[1]:
        raise UnsupportedModelError(f"cannot shrink {path}{width[0]}={width[1]}: not a multiple of {heads[0]}={heads[1]}")
    head = _head_dim(d)
    ropes = [("", d)] + [(f"{k}.", d[k]) for k in ("rope_parameters", "rope_scaling") if isinstance(d.get(k), dict)]
    for where, r in ropes:
        for f in ("partial_rotary_factor", "rotary_pct"):
            factor = r.get(f)
            if isinstance(factor, float) and head and int(head * factor) % 2:
                raise UnsupportedModelError(f"cannot shrink {path}{where}{f}={factor}: {head} x {factor} rotary dims is odd")
    if isinstance(d.get("rotary_dim"), int) and head:
        d["rotary_dim"] = min(d["rotary_dim"], head)


def shrunk_config(config: PretrainedConfig, layers: int = 2, family: Family | None = None) -> PretrainedConfig:
    """`config` with small widths (`widths_of` its family: by default the one registered for its model_type) and at
    most `layers` blocks in each block list; raises UnsupportedModelError, naming the field, where that cannot be
    built consistently."""
    family = family if family is not None else REGISTRY.get(config.model_type)
    d = _shrink_dict(config.to_dict(), layers, "", widths_of(family))
    try:
        new = type(config).from_dict(d)
    except Exception as e:  # noqa: BLE001 - any config validation error: report it in one line
        raise UnsupportedModelError(f"cannot shrink {config.model_type}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    new._attn_implementation = "eager"
    return new


@torch.no_grad()
def _build(config: PretrainedConfig, cls: type, device: str) -> PreTrainedModel:
    try:
        with torch.device(device):
            return cls(config)
    except Exception as e:  # noqa: BLE001
        raise UnsupportedModelError(f"cannot build a shrunk {cls.__name__}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


@torch.no_grad()
def randomize_(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """Gains and biases made random too (so every move shows), zero-initialised matrices given values, all
    rounded to bfloat16 as a bf16 checkpoint's weights are."""
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        if p.dim() == 1:
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        elif not p.any():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        p.copy_(p.bfloat16().float())
    return model.eval()


def _sharing(model: nn.Module) -> dict[str, str]:
    """parameter name -> the first name of the tensor it is (a tied weight's names all map to one)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


@torch.no_grad()
def share_like(small: PreTrainedModel, real: PreTrainedModel) -> PreTrainedModel:
    """Tie and untie `small`'s parameters as `real`'s are, for every name both have (the config alone does not
    say: transformers unties a head the checkpoint stores apart, and T5's config forces `tie_word_embeddings`).
    An untied copy gets values of its own."""
    want, have = _sharing(real), _sharing(small)
    params = dict(small.named_parameters(remove_duplicate=False))
    groups: dict[tuple, list[str]] = defaultdict(list)  # the tensor each name must be -> its names
    for name in have:
        groups[("real", want[name]) if name in want else ("small", have[name])].append(name)
    for names in groups.values():
        p = params[names[0]]
        alone = {n for n in have if have[n] == have[names[0]]} == set(names)  # p is exactly these names' tensor
        if not alone:
            p = nn.Parameter(p.detach().clone() + torch.randn_like(p) * 0.02, requires_grad=p.requires_grad)
        for name in names:
            if params[name] is not p:
                module, _, attr = name.rpartition(".")
                setattr(small.get_submodule(module), attr, p)
    return small


# ----- block kinds

_FLAG = (bool, str, type(None))


def block_signature(block: nn.Module) -> tuple:
    """What makes two blocks the same kind: every submodule's name and class, and its flag-like attributes."""
    sig = []
    for name, m in block.named_modules():
        flags = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k != "training" and isinstance(v, _FLAG)))
        sig.append((name, type(m).__name__, flags))
    return tuple(sig)


def _block_lists(model: nn.Module) -> dict[str, list[tuple]]:
    """block list prefix -> the kind of each of its blocks, in order: its signature, and whether it is the
    first and the last of its list (what the embeddings or the final norm move reaches only those)."""
    out: dict[str, list[tuple]] = defaultdict(list)
    for b in find_blocks(model):
        prefix, _ = b.rsplit(".", 1)
        out[prefix].append(block_signature(model.get_submodule(b)))
    return {p: [(s, i == 0, i == len(sigs) - 1) for i, s in enumerate(sigs)] for p, sigs in out.items()}


def _has_spans(groups: list[Group]) -> bool:
    return any(len(g.blocks) > 1 for g in groups)


def _uncovered(real: dict, small: dict, pairs: bool) -> str | None:
    """Why `small`'s blocks do not hold every kind (and consecutive pair of kinds) of `real`'s; None if they do."""
    if real.keys() != small.keys():
        return f"block lists differ ({sorted(real)} vs {sorted(small)})"
    for prefix, sigs in real.items():
        have = set(small[prefix])
        missing = [i for i, s in enumerate(sigs) if s not in have]
        if missing:
            return f"{prefix}.{missing[0]} has a kind no shrunk block has"
        if pairs:
            have2 = set(zip(small[prefix], small[prefix][1:]))
            missing = [i for i, p in enumerate(zip(sigs, sigs[1:])) if p not in have2]
            if missing:
                return f"{prefix}.{missing[0]}-{missing[0] + 1} is a pair of kinds no two shrunk blocks are"
    return None


def shrunk_model(model: PreTrainedModel, groups: list[Group] | None = None, seed: int = 0,
                 family: Family | None = None) -> PreTrainedModel:
    """A random float32 model of `model`'s class and config, small widths, and the fewest leading blocks that hold
    every kind of block `model` has (and every consecutive pair, where `groups` span two blocks); the widths those
    of `family` (by default the one registered for its model_type). `model` may be on the meta device (a streamed
    model): only its structure is read."""
    real = _block_lists(model)
    pairs = groups is not None and _has_spans(groups)
    most = max((len(s) for s in real.values()), default=1)
    why: str | None = "no block lists"
    for layers in range(min(2, most), min(most, MAX_BLOCKS) + 1):
        try:  # some cuts do not build (Gemma 4: a shared-KV block with no block of its type before the cut)
            config = shrunk_config(model.config, layers, family)
            why = _uncovered(real, _block_lists(_build(config, type(model), "meta")), pairs)
        except UnsupportedModelError as e:
            why = str(e)
            continue
        if why is None:
            torch.manual_seed(seed)  # the constructor's own initialisation
            with torch.random.fork_rng(devices=[]):
                return randomize_(share_like(_build(config, type(model), "cpu").float(), model), seed)
    raise UnsupportedModelError(f"cannot shrink {model.config.model_type} (up to {min(most, MAX_BLOCKS)} blocks): {why}")


# ----- mapping the shrunk probe onto the real model

def _experts(model: nn.Module) -> dict[str, int]:
    """fused experts module name -> how many experts it stacks."""
    return {n: m.gate_up_proj.shape[0] for n, m in model.named_modules() if is_fused_experts(m)}


class _Mapping:
    def __init__(self, real: PreTrainedModel, small: PreTrainedModel, spans: bool):
        self.real_lists, self.small_lists = _block_lists(real), _block_lists(small)
        self.real_experts, self.small_experts = _experts(real), _experts(small)
        # real block -> the shrunk block of its kind (the first), and for spans: (i, i+1) -> (j, j+1)
        self.rep: dict[str, str] = {}
        self.pair_rep: dict[str, str] = {}
        for prefix, sigs in self.real_lists.items():
            small_sigs = self.small_lists[prefix]
            first: dict[tuple, int] = {}  # block kind -> its first shrunk block
            for j, s in enumerate(small_sigs):
                first.setdefault(s, j)
            first_pair: dict[tuple[tuple, tuple], int] = {}
            for j, p in enumerate(zip(small_sigs, small_sigs[1:])):
                first_pair.setdefault(p, j)
            for i, s in enumerate(sigs):
                self.rep[f"{prefix}.{i}"] = f"{prefix}.{first[s]}"
                if spans and i + 1 < len(sigs):
                    self.pair_rep[f"{prefix}.{i}"] = f"{prefix}.{first_pair[(s, sigs[i + 1])]}"
        self.real_of: dict[str, list[str]] = defaultdict(list)  # shrunk block -> the real blocks it stands for
        for real_block, small_block in self.rep.items():
            self.real_of[small_block].append(real_block)
        self.small_blocks = [f"{p}.{j}" for p, s in self.small_lists.items() for j in range(len(s))]

    def rename(self, site: str, blocks: dict[str, list[str]], expert: int | None = None) -> list[str]:
        """A shrunk site under each real name it stands for; `blocks`: shrunk block -> the real blocks it stands
        for here (a site in a shrunk block not named there stands for nothing). An expert's site stands for each
        real expert it is taken for (k % shrunk experts), or for real expert `expert` alone where that is given."""
        parsed = Site.parse(site)
        module = parsed.module
        b = block_of(module, self.small_blocks)
        modules = [module] if b is None else [r + module[len(b):] for r in blocks.get(b, ())]
        if parsed.expert is None:
            return [str(Site(x, parsed.kind, parsed.call)) for x in modules]
        n_small = self.small_experts.get(module)
        out = []
        for x in modules:
            n_real = self.real_experts.get(x)
            if n_small is None or n_real is None:
                raise UnsupportedModelError(f"{site}: no fused experts module {x} in the real model")
            ks = [expert] if expert is not None else [k for k in range(n_real) if k % n_small == parsed.expert]
            out += [str(Site.of_expert(x, k, parsed.part).at_call(parsed.call)) for k in ks]
        return out


def map_governed(real: PreTrainedModel, real_groups: list[Group], small: PreTrainedModel, small_groups: list[Group],
                 governed: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The shrunk model's probe result for the real model's groups (see the module's docstring)."""
    mp = _Mapping(real, small, _has_spans(real_groups))
    small_names = {g.name for g in small_groups}
    out: dict[str, dict[str, float]] = {}
    for g in real_groups:
        if g.block is None:  # a whole-model group: every real block reads the shrunk block of its kind
            counterpart, blocks = g.name, mp.real_of
        else:
            j = (mp.pair_rep if len(g.blocks) > 1 else mp.rep).get(g.block)
            if j is None:
                raise UnsupportedModelError(f"group {g.name}: no shrunk block of its kind")
            blocks = {j: [g.block]}
            if len(g.blocks) > 1:
                blocks[_next(j)] = [_next(g.block)]
            counterpart = f"{g.spec}@{j}"
            if g.expert is not None:
                counterpart = _expert_counterpart(g, counterpart, small_groups, governed)
        if counterpart not in small_names:
            raise UnsupportedModelError(f"group {g.name}: the shrunk model has no group {counterpart}")
        moved = out[g.name] = {}
        for site, power in governed[counterpart].items():
            for name in mp.rename(site, blocks, g.expert):
                moved[name] = power
    return out


def _expert_counterpart(g: Group, block_spec: str, small_groups: list[Group], governed: dict) -> str:
    """The shrunk expert group standing for real expert g.expert: expert g.expert % n of the same block, or, where
    the probe's few tokens reached no token to it (its sites were never measured), the next expert that was
    reached: every expert of one block is the same module, so any reached one shows what the group moves."""
    assert g.expert is not None  # called for expert groups only
    n = sum(1 for s in small_groups if f"{s.spec}@{s.block}" == block_spec) or 1
    names = [f"{block_spec}#{(g.expert + i) % n}" for i in range(n)]
    return next((c for c in names if governed.get(c)), names[0])


def _next(block: str) -> str:
    prefix, i = block.rsplit(".", 1)
    return f"{prefix}.{int(i) + 1}"


def probe_governed(model: PreTrainedModel, family: Family, groups: list[Group], ids) -> dict[str, dict[str, float]]:
    """`probe.probe`'s result for `model`, measured on a shrunk random copy (the real model is not run). Where
    no shrunk copy can stand for the model, the model itself is probed, and the log says why."""
    try:
        small = shrunk_model(model, groups, family=family)
        small_groups = expand(family, small)
    except UnsupportedModelError as e:
        log.warning("%s; probing the model itself", e)
        return probe(model, family, groups, ids)
    with one_thread():
        governed = probe(small, family, small_groups, ids)  # raises if the family data does not hold
    try:
        return map_governed(model, groups, small, small_groups, governed)
    except UnsupportedModelError as e:
        log.warning("%s; probing the model itself", e)
        return probe(model, family, groups, ids)
