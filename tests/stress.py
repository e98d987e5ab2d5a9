"""Stress models that overflow float16 in their *activations only*, built from each family's data.

Real bf16-pretrained models overflow through a few "massive" residual channels that grow with depth
(the BOS token's channels in Gemma, T5's `wo` outputs), while every weight stays small. This module makes
the same shape from a tiny random model: the tensors that write into the residual stream are amplified on a
few channels only, more in deeper blocks, by a power of two chosen until the fp32 residual stream passes
float16's maximum by at least 2 bits while every weight stays under 65504. Amplifying channels is not a
rescaling, so the stress model computes a *different* function; it is the fp32 reference the conversion
must then match.

What is amplified is read from the family data (halfsafe.families), so a new family needs nothing here:
- the residual writers of every block (`Family.residual_writers`, each block's set chosen as the fp32-residual
  baseline chooses it), by what the module is: a Linear's rows c (and bias), a GPT-2 Conv1D's columns c, a
  norm's gain (its 1 + w where `Family.one_plus_norm_gains`); in a writer that is a whole mixture-of-experts
  block, its fused experts' down projections (rows or columns c as `is_transposed` lays them out, and their
  bias) and the Linears in it that a pair group ends (a shared expert's down_proj);
- what feeds each writer: for a Linear, Conv1D or experts, whole, what a per-block pair group moves against
  it (the +1 side of a group moving it by -1: v_proj for o_proj, up_proj for down_proj, the up rows of a fused
  gate_up_proj), so the writer's input grows too; for a norm (sandwich and post-branch norms), the rows c of
  the module whose output it normalises (found by running the model once) where that is a branch's output
  projection, a Linear a pair group ends (o_proj, down_proj), so the massive channels dominate what the norm
  normalises;
- what `Family.stress` says where the rest cannot (families/spec.py, StressHint): the towers (vision, audio)
  whose blocks stay as they are, rows to grow that running the model cannot find (Gemma 4), and in post-norm
  families, whose every write a LayerNorm renormalises, the norm gains to grow and the attention inputs to
  shrink instead.

What catches a mistake in the family data, now that the stress reads it: the rescale reads the groups, the
stress mainly the residual writers, which no rescale reads. A writer the groups forget is still amplified
here, so the converted model still overflows and tests/test_families.py fails. Writers naming modules outside
the stream grow it at best through what reads them; where nothing then overflows, make_stress raises
StressError, which fails the test (even one expected to fail its assertions). What no test catches: a set
missing one writer where the others still overflow (tests/test_family_registry.py checks only that every
block's writers exist), nor a feed taken from a pair group that is exact but does not feed the writer (the
stress is then milder or harsher, no less valid).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from halfsafe.core.groups import expand, select_parts
from halfsafe.core.sites import block_of, find_blocks
from halfsafe.core.stats import is_fused_experts
from halfsafe.families import family_for
from halfsafe.families.spec import BLOCK
from halfsafe.runtime.baselines import residual_writers

FP16_MAX = 65504.0
CHANNELS = (3, 17, 41)  # the massive channels (hidden size 64 in tests/tiny)

# How a tensor writes channel c of the residual stream, or reads it:
ROW = "row"  # a Linear [hidden, in]: row c, and its bias[c]
COL = "col"  # a GPT-2 Conv1D [in, hidden]: column c, and its bias[c]
GAIN = "gain"  # a norm gain x*w (LayerNorm, T5/Llama RMSNorm): w[c], and the norm's bias[c]
GAIN1P = "gain1p"  # a Gemma x*(1+w) gain: (1+w[c]) amplified
EXPERT_ROW = "expert_row"  # fused expert down projections [experts, hidden, in]: hidden row c of every expert
EXPERT_COL = "expert_col"  # transposed ones (gpt-oss) [experts, in, hidden]: column c, and the bias [experts, hidden]
FEED = "feed"  # what a writer reads (up_proj, v_proj, fc1, wi): the whole tensor or part, so the writer's input grows
READ = "read"  # a post-norm model's query/key read the amplified stream directly: columns c shrink by the same
# factor, as trained models keep attention logits moderate on their massive (attention-sink) channels


class StressError(RuntimeError):
    """No stress model could be built. Not an AssertionError: a test expected to fail an assertion (a strict xfail)
    must not pass on a stress that never overflowed."""


@dataclass(frozen=True)
class Amp:
    """One tensor of the stress: how it is amplified, the depth that grows its factor, and (feeds) its part."""

    param: str
    how: str
    depth: int = 0
    select: tuple = ()  # (dim, index) pairs: the part a feed amplifies (empty: the whole tensor)


def stress_plan(model: nn.Module, run) -> list[Amp]:
    """Every tensor make_stress amplifies in `model`, read from its family's data (see the module docstring);
    `run()` runs the model once, to find what feeds each norm that writes."""
    family = family_for(model.config.model_type)
    hint = family.stress
    if hint.norms:
        return [*_matching(model, hint.norms, GAIN), *_matching(model, hint.reads, READ)]
    blocks = find_blocks(model)
    towers = [_regex(model, t) for t in hint.towers]
    writers = [(w, b) for w in residual_writers(model) for b in [block_of(w, blocks)]
               if b is not None and not any(t.match(b) for t in towers)]
    norms = [w for w, _ in writers if _is_norm(model.get_submodule(w))]
    fed_by = _fed_by(model, run, norms)
    groups = expand(family, model)
    amps: list[Amp] = []
    for writer, block in writers:
        depth = _index(block) + 1
        if writer in norms:
            amps.append(Amp(f"{writer}.weight", GAIN1P if family.one_plus_norm_gains else GAIN, depth))
            amps += [Amp(p, how, depth) for p, how in _branch_output(model, fed_by.get(writer), groups)]
        else:
            written = [Amp(p, how, depth) for p, how in _writes(model, writer, groups)]
            if not written:
                raise StressError(f"residual writer {writer} ({type(model.get_submodule(writer)).__name__}): nothing to amplify")
            amps += written + _feeds(written, groups)
    once = {(a.param, a.how, repr(a.select)): a for a in reversed(amps + _matching(model, hint.rows, ROW))}
    return list(reversed(once.values()))  # each part once, in order: a row the hint names may be traced too


def _is_norm(m: nn.Module) -> bool:
    """A norm with a gain: a module of its own (no children) whose one weight is a vector."""
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and next(m.children(), None) is None


def _index(block: str) -> int:
    return int(block.rsplit(".", 1)[1])


def _writes(model: nn.Module, name: str | None, groups) -> Iterator[tuple[str, str]]:
    """(parameter, how) for what writes module `name`'s output: a Linear's rows, a Conv1D's columns; in a larger
    module (a mixture-of-experts block), its fused experts' down projections and every Linear in it that a pair
    group ends (moves by -1, against another tensor's +1: a shared expert's down_proj)."""
    if name is None:
        return
    module = model.get_submodule(name)
    if isinstance(module, nn.Linear):
        yield f"{name}.weight", ROW
    elif type(module).__name__ == "Conv1D":  # transformers' GPT-2 layer: weight [in, out]
        yield f"{name}.weight", COL
    else:
        ended = _ended(groups)
        for sub, m in module.named_modules(prefix=name):
            if is_fused_experts(m):
                yield f"{sub}.down_proj", EXPERT_COL if m.is_transposed else EXPERT_ROW
            elif isinstance(m, nn.Linear) and f"{sub}.weight" in ended:
                yield f"{sub}.weight", ROW


def _ended(groups) -> set[str]:
    """Tensors a per-block pair group ends: moved by -1 against another tensor's +1 (o_proj, down_proj, wo)."""
    return {m.param for g in groups if g.block is not None and any(m.power > 0 for m in g.moves) for m in g.moves if m.power < 0}


def _branch_output(model: nn.Module, name: str | None, groups) -> Iterator[tuple[str, str]]:
    """The rows of the module a norm writer normalises, where it is a branch's output projection (a Linear a pair
    group ends: o_proj, down_proj), so the massive channels dominate what the norm normalises."""
    if name is not None and isinstance(model.get_submodule(name), nn.Linear) and f"{name}.weight" in _ended(groups):
        yield f"{name}.weight", ROW


def _feeds(written: list[Amp], groups) -> list[Amp]:
    """What feeds the tensors `written`: the +1 side of every per-block pair group that moves one of them by -1.
    Fused experts are not fed: their down projections alone carry the massive channels, as a dense MLP's do with its
    up_proj fed, while growing every expert's up rows as well made mixtral's and deepseek_v3's stress models so harsh
    that their converted fp16 came within 2x of bf16 on held-out text (25x and 70x without)."""
    params = {a.param for a in written}
    feeds: dict[tuple[str, str], Amp] = {}
    for g in groups:
        if g.block is not None and g.expert is None and any(m.param in params and m.power < 0 for m in g.moves):
            for m in g.moves:
                if m.power > 0:
                    feeds.setdefault((m.param, repr(m.select)), Amp(m.param, FEED, select=select_parts(m.select)))
    return list(feeds.values())


@torch.no_grad()
def _fed_by(model: nn.Module, run, norms: list[str]) -> dict[str, str]:
    """norm -> the module whose output it normalises (the tensor the norm reads is that module's output itself),
    for each of `norms`, seen in one `run()`."""
    if not norms:
        return {}
    made: dict[int, tuple[str, torch.Tensor]] = {}  # id of an output -> (its module, the output: kept, so ids stay unique)
    fed_by: dict[str, str] = {}

    def wrote(name):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):  # the first module to put it out (dropout passes it on as it is)
                made.setdefault(id(out), (name, out))
        return hook

    def reads(name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if id(x) in made:
                fed_by.setdefault(name, made[id(x)][0])
        return hook

    modules = dict(model.named_modules())
    handles = [m.register_forward_hook(wrote(n)) for n, m in modules.items() if n and next(m.children(), None) is None]
    handles += [modules[n].register_forward_pre_hook(reads(n), with_kwargs=True) for n in norms]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return fed_by


def _regex(model: nn.Module, template: str, whole: bool = False) -> re.Pattern:
    """A module template (`{i}`: any block) as a regex on `model`'s module names: the name itself or (not `whole`)
    any module inside it. Templates name modules of the model with a head; a bare base model drops the prefix."""
    prefix = f"{model.base_model_prefix}."
    if getattr(model, "base_model", None) is model and template.startswith(prefix):
        template = template[len(prefix):]
    return re.compile("^" + re.escape(template).replace(re.escape(BLOCK), r"(\d+)") + ("$" if whole else r"(\.|$)"))


def _matching(model: nn.Module, templates: tuple[str, ...], how: str) -> list[Amp]:
    """The weights of the modules `templates` name (`{i}`: any block, its depth i + 1; none: depth 0)."""
    out = []
    for template in templates:
        rx = _regex(model, template, whole=True)
        for name, _ in model.named_modules():
            m = rx.match(name)
            if m:
                out.append(Amp(f"{name}.weight", how, int(m.group(1)) + 1 if m.groups() else 0))
    if templates and not out:
        raise StressError(f"no module of {type(model).__name__} matches {templates} (Family.stress)")
    return out


@torch.no_grad()
def _amplify(model: nn.Module, amps: list[Amp], log2_factor: float) -> None:
    """Multiply the massive channels of every writer by 2**(log2_factor + depth), every feed (whole, or the part
    its group moves) by 2**log2_factor, and divide the reads' columns on those channels by 2**log2_factor."""
    params = dict(model.named_parameters())
    c = list(CHANNELS)
    for a in amps:
        p, f = params[a.param], 2.0 ** (log2_factor + a.depth)
        bias = params.get(a.param.removesuffix("weight") + "bias" if a.param.endswith(".weight") else a.param + "_bias")
        if a.how in (ROW, GAIN):
            p[c] *= f
            if bias is not None:
                bias[c] *= f
        elif a.how == COL:
            p[:, c] *= f
            if bias is not None:
                bias[c] *= f
        elif a.how == GAIN1P:
            p[c] = (1 + p[c]) * f - 1
        elif a.how in (EXPERT_ROW, EXPERT_COL):
            p[(slice(None), c) if a.how == EXPERT_ROW else (slice(None), slice(None), c)] *= f
            if bias is not None:
                bias[:, c] *= f
        elif a.how == READ:
            p[:, c] /= 2.0 ** log2_factor
        elif a.how == FEED:
            index = [slice(None)] * p.dim()
            for dim, part in a.select:
                index[dim] = part
            p[tuple(index)] *= 2.0 ** log2_factor


@torch.no_grad()
def activation_peak(model: nn.Module, run) -> float:
    """The largest |value| any module outputs during `run()`, measured with plain forward hooks."""
    peak = [0.0]

    def hook(module, args, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            peak[0] = max(peak[0], float(t.detach().abs().max()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if m is not model]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return peak[0]


def weight_peak(model: nn.Module) -> float:
    return max(float(p.detach().abs().max()) for p in model.parameters())


@torch.no_grad()
def make_stress(model: nn.Module, run, margin_bits: float = 2.0, start: int = 12, stop: int = 48) -> float:
    """Amplify `model` in place until its fp32 activations pass 65504 by `margin_bits` (measured with `run()`),
    keeping every weight under 65504. Returns the log2 factor used; fails if no factor does both."""
    amps = stress_plan(model, run)
    if not amps:
        raise StressError(f"the family data of {model.config.model_type} names nothing to amplify")
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k in (half / 2 for half in range(start, stop)):  # factors 2**(k/2): not a rescale halfsafe could undo
        _amplify(model, amps, k)
        if weight_peak(model) >= FP16_MAX:
            break
        if activation_peak(model, run) > FP16_MAX * 2.0 ** margin_bits:
            return k
        for n, p in model.named_parameters():
            p.copy_(original[n])
    raise StressError(f"no amplification of {type(model).__name__} overflows activations with every weight < 65504")


def log2_ratio(a: float, b: float) -> float:
    return math.log2(a / b)


@torch.no_grad()
def grow_t5_stacks(model, run, margin_bits: float = 2.0, massive_bits: float = 4.0) -> int:
    """A T5 with an untied head, at real depth (12+ blocks per stack), grown as bf16 training grows T5's: massive
    channels written by the feed-forwards, larger along each stack (block i of L: the channels' wo rows x
    2**(massive_bits (i+1) / L)), then the whole residual stream scaled by 2**k, the smallest k that passes 65504
    by `margin_bits`, with every weight under 65504. The 2**k is exact, written here from T5's modeling file (the
    shared embedding and every o and wo x 2**k, every T5LayerNorm eps x 4**k: each norm's output and the logits stay
    what they were), so the function differs from the random model only by the massive channels. Returns k."""
    assert model.lm_head.weight is not model.shared.weight, "a tied head would need the final norm's gain too"
    for stack in (model.encoder, model.decoder):
        for i, block in enumerate(stack.block):
            block.layer[-1].DenseReluDense.wo.weight[list(CHANNELS)] *= 2.0 ** (massive_bits * (i + 1) / len(stack.block))
    k = math.ceil(math.log2(FP16_MAX * 2.0 ** margin_bits / activation_peak(model, run)))
    model.shared.weight *= 2.0 ** k
    for name, p in model.named_parameters():
        if re.search(r"\.(SelfAttention|EncDecAttention)\.o\.weight$|\.DenseReluDense\.wo\.weight$", name):
            p *= 2.0 ** k
    for m in model.modules():
        if type(m).__name__ == "T5LayerNorm":
            m.variance_epsilon *= 4.0 ** k
    model.config.layer_norm_epsilon *= 4.0 ** k
    assert weight_peak(model) < FP16_MAX and activation_peak(model, run) > FP16_MAX * 2.0 ** margin_bits
    return k
