"""The vocabulary family data is written in: which tensors move together under one power-of-two scale.

A *group* is a set of tensors that must be multiplied together for the network to compute the same
function; one integer exponent e per group scales them all (scale s = 2**e, each tensor by s**power).
Templates name parameters as `named_parameters()` does (tied weights under their first name). A template
holds at most one placeholder:
- `{i}`: a block index. In a per-block group, the group's own block; in a whole-model group, every block.
- `{i+1}` (per-block groups only): the block after the group's own, for what a block's last norm feeds
  (post-norm models: the norm ending block i is read by block i+1). A per-block group with `{i+1}` has one
  group per block that has a successor; what the last block's norm feeds (a head, a pooler, the decoder)
  belongs in a separate whole-model group that names it with `{last}`.
- `{last}` (whole-model groups only): the last block of that list, i.e. the highest index the template
  matches, which must also be the last element of its ModuleList.
groups.expand fails loudly when templates match different blocks (see there for the rules).

Fused mixture-of-experts weights stack every expert of a block in one tensor (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]). A `per_expert` group is a per-block group repeated for each
expert e: every move names the dim its tensor stacks experts along (`Move.expert`), and takes expert e's
slice there (and, with `select`, only part of that slice, e.g. the up rows of `gate_up_proj`).

A group whose tensors scale the input of norms by s names `eps_power` (2 for x / sqrt(mean(x^2) + eps)): the
norms' eps must move by s**eps_power too. Where that eps lives is one `EpsScope` (the config fields holding it,
the norms that copied it): the family's (`Family.eps`), or a group's own (`GroupSpec.eps`: a tower's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

MUL = "mul"  # t -> s**power * t
GAIN1P = "gain1p"  # x*(1+w) norms (Gemma): w -> s**power * (1 + w) - 1
KINDS = (MUL, GAIN1P)
BLOCK, NEXT_BLOCK, LAST_BLOCK = "{i}", "{i+1}", "{last}"
PLACEHOLDERS = (BLOCK, NEXT_BLOCK, LAST_BLOCK)


def placeholders(template: str) -> list[str]:
    """Every `{...}` in a template (parameter names never hold braces)."""
    return re.findall(r"\{[^{}]*\}", template)


def placeholder(template: str) -> str | None:
    """The one placeholder a template holds, or None."""
    found = placeholders(template)
    return found[0] if found else None


@dataclass(frozen=True)
class Move:
    param: str
    power: int = 1
    kind: str = MUL
    optional: bool = False  # may be absent (e.g. biases that some configs switch off)
    # Part of the tensor only: (dim, fn(config) -> slice or index list), e.g. the V rows of a fused QKV.
    select: tuple[int, Callable] | None = None
    when: Callable | None = None  # fn(model) -> bool: the move applies to this model (e.g. `tied_head`)
    expert: int | None = None  # the dim the tensor stacks experts along (moves of a per_expert group)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Move {self.param}: kind must be one of {KINDS}, not {self.kind!r}")
        if self.power == 0:
            raise ValueError(f"Move {self.param}: power 0 moves nothing")
        if self.kind == GAIN1P and (self.select is not None or self.expert is not None):
            raise ValueError(f"Move {self.param}: a (1+w) gain moves whole")
        if self.select is not None and self.expert is not None and self.select[0] == self.expert:
            raise ValueError(f"Move {self.param}: select and expert name the same dim {self.expert}")


@dataclass(frozen=True)
class EpsScope:
    """Where one norm eps lives: the config fields holding it and the norms that copied it at construction. A
    group's `eps_power` moves it by s**eps_power: the family's (`Family.eps`, for every such group) or the group's
    own (`GroupSpec.eps`, a tower's). groups.expand resolves it for each model (sub-config paths, module names
    as that model names them) into the `EpsHolders` that rewrite moves.

    attrs: the config fields holding the eps ("rms_norm_eps"; a config lacking one is skipped). Empty: no config
        holds it, the modeling code fixes every norm's eps at `fixed_value` (nn.LayerNorm's default): nothing moves.
    configs: dotted paths from the model's config to the configs holding it ("vision_config"; "" the model's
        config itself), each of which must hold one of `attrs`; a config a covered sub-model keeps moves only where
        it holds the same value (a copy). Empty: the model's config and its text config (`get_text_config()`),
        and every config a covered sub-model keeps that holds the field (the stacks or halves of one model).
    modules: module-name prefixes whose norms read it (as templates name parameters); empty: every module.
    keep: prefixes inside those whose norms keep an eps of their own, even where it holds the same value (a tower).
    fixed: module-name suffixes of norms whose eps the modeling code fixes at `fixed_value` instead of reading the
        config: a checkpoint cannot carry a moved one, so it never moves, even where it equals the config's value.
    when: fn(model) -> bool: the eps moves in this model (a tower that keeps its scale where it clamps to stored
        bounds); None: always."""

    attrs: tuple[str, ...]
    configs: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    keep: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()
    fixed_value: float = 0.0
    when: Callable | None = None

    def __post_init__(self):
        for name in ("attrs", "configs", "modules", "keep", "fixed"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{self._name}: {name} is a tuple of names, not {value!r}")
            if any(not v for v in value) and name != "configs":
                raise ValueError(f"{self._name}: {name} holds an empty name")
        if any("." in a for a in self.attrs):
            raise ValueError(f"{self._name}: attrs are field names; the configs holding them go in `configs`")
        if any(c.startswith(".") or c.endswith(".") or ".." in c for c in self.configs):
            raise ValueError(f"{self._name}: configs are dotted paths from the model's config, not {self.configs}")
        if not self.attrs and (self.fixed_value <= 0 or self.configs or self.modules or self.keep or self.fixed or self.when):
            raise ValueError(f"{self._name}: with no config field (attrs) the code fixes every norm's eps: give that "
                             "value (fixed_value) and nothing else")
        if bool(self.fixed) != (self.fixed_value > 0) and self.attrs:
            raise ValueError(f"{self._name}: fixed (the norms whose eps the code fixes) and fixed_value (that eps) go together")
        stray = [k for k in self.keep if self.modules and not any(k == m or k.startswith(m + ".") for m in self.modules)]
        if stray:
            raise ValueError(f"{self._name}: keep {stray} lies outside modules {self.modules}: nothing there moves anyway")

    @property
    def _name(self) -> str:
        return f"EpsScope {', '.join(self.attrs) or self.fixed_value}"


@dataclass(frozen=True)
class GroupSpec:
    name: str
    moves: tuple[Move, ...]
    per_block: bool = False  # one group per value of {i} (a pair inside one block) or one for all
    eps_power: int = 0  # the family's norm eps moves by s**eps_power (every norm input scales by s)
    when: Callable | None = None  # fn(model) -> bool: the group exists for this model
    # Per-block groups only: fn(model) -> block indices the group may be made for (others keep their scale),
    # for pairs that are exact in some blocks of a model only (e.g. not where another block reads the result).
    blocks: Callable | None = None
    why: str = ""
    # The eps this group's eps_power moves, where it is not the family's (`Family.eps`): the group's own, in a model
    # whose parts have norms of their own eps (a vision tower beside a language model). One field of one config
    # (the plan records it as "vision_config.layer_norm_eps"), with the modules whose norms copied it.
    eps: EpsScope | None = None
    per_expert: bool = False  # per block, one group per expert (fused expert tensors; see the module doc)

    def __post_init__(self):
        for m in self.moves:
            found = placeholders(m.param)
            if len(found) > 1 or any(p not in PLACEHOLDERS for p in found):
                raise ValueError(f"group {self.name}: {m.param!r} may hold one of {PLACEHOLDERS}, not {found}")
        kinds = [placeholder(m.param) for m in self.moves]
        if self.per_block and not all(k in (BLOCK, NEXT_BLOCK) for k in kinds):
            raise ValueError(f"group {self.name}: a per-block group needs {{i}} (or {{i+1}}) in every template")
        if self.per_block and not any(k == BLOCK and not m.optional for k, m in zip(kinds, self.moves)):
            raise ValueError(f"group {self.name}: a per-block group needs a non-optional {{i}} template (its own block)")
        if not self.per_block and NEXT_BLOCK in kinds:
            raise ValueError(f"group {self.name}: {{i+1}} only makes sense in a per-block group")
        if self.blocks is not None and not self.per_block:
            raise ValueError(f"group {self.name}: only a per-block group can be limited to some blocks")
        if self.per_expert and not (self.per_block and all(m.expert is not None for m in self.moves)):
            raise ValueError(f"group {self.name}: a per_expert group is per_block and every move names its expert dim")
        if not self.per_expert and any(m.expert is not None for m in self.moves):
            raise ValueError(f"group {self.name}: Move.expert only makes sense in a per_expert group")
        if self.per_block and self.eps_power:
            raise ValueError(f"group {self.name}: only a whole-model group can move the shared norm eps")
        if self.eps is not None:
            _check_own_eps(self)
        # Parts of one fused tensor (distinct selects) may move by different powers (Q rows x c, K rows / c);
        # groups.expand checks that such parts do not overlap.
        if len({(m.param, m.select) for m in self.moves}) != len(self.moves):
            raise ValueError(f"group {self.name}: a template is listed twice")


def _check_own_eps(group: GroupSpec) -> None:
    """A group's own eps: one config field that the group's eps_power moves whenever the group exists."""
    eps = group.eps
    if not isinstance(eps, EpsScope):
        raise ValueError(f"group {group.name}: eps is an EpsScope, not {eps!r}")
    if not group.eps_power:
        raise ValueError(f"group {group.name}: an eps of its own moves by the group's eps_power, which is 0")
    if len(eps.configs) != 1 or len(eps.attrs) != 1 or not eps.configs[0]:
        raise ValueError(f"group {group.name}: a group's own eps is one field of one sub-config (configs=('vision_config',), "
                         f"attrs=('layer_norm_eps',)), not configs {eps.configs}, attrs {eps.attrs}")
    if not eps.modules:
        raise ValueError(f"group {group.name}: name the modules whose norms read the group's own eps (a tower's prefix)")
    if eps.when is not None:
        raise ValueError(f"group {group.name}: a group's own eps moves wherever the group does: put `when` on the GroupSpec")


@dataclass(frozen=True)
class StressHint:
    """What tests/stress.py, which builds models whose activations overflow float16 from the family data, cannot
    read from the rest of it. Module names as templates name parameters, holding `{i}` (every block) or no
    placeholder.

    towers: modules holding a tower beside the language model (vision, audio), whose own residual streams the
        stress leaves as they are: it blows up the language model's, as bf16 training does.
    norms: in post-norm families, the norms whose outputs are the residual stream. Each branch's write is added
        to the stream and the sum normalised (LN(h + write)), so residual_writers cannot grow it (a grown write
        only dominates what its norm renormalises): the stress grows these norms' gains instead.
    reads: in post-norm families, the projections whose products read the stream directly (queries and keys):
        the stress shrinks their input columns on the channels it grows, as trained models keep attention logits
        moderate on their massive channels.
    rows: Linears whose rows on the grown channels grow with the block's writers, where the stress cannot find
        them by running the model: a sandwich norm that normalises a sum of branches (Gemma 4's MoE blocks)
        rather than one branch's output projection."""

    towers: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()

    def __post_init__(self):
        for template in (*self.towers, *self.norms, *self.reads, *self.rows):
            if any(p != BLOCK for p in placeholders(template)):
                raise ValueError(f"StressHint: {template!r} may hold {BLOCK} only")
        if bool(self.norms) != bool(self.reads):
            raise ValueError("StressHint: a post-norm family names both the norms writing its stream and what reads it")


ONNX_ENCODER, ONNX_SEQ2SEQ = "encoder", "seq2seq"
ONNX_KINDS = (ONNX_ENCODER, ONNX_SEQ2SEQ)


@dataclass(frozen=True)
class OnnxExport:
    """Which ONNX exporter takes the family's model types (halfsafe.export.exporters reads it): ONNX_ENCODER, one
    graph of a BERT-style encoder, or ONNX_SEQ2SEQ, an encoder-decoder's two graphs. A decoder-only causal LM needs
    none: the decoder exporter takes any causal LM.

    model_types: the family's model types it covers, where not all of them are (empty: every one)."""

    kind: str
    model_types: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in ONNX_KINDS:
            raise ValueError(f"OnnxExport: kind must be one of {ONNX_KINDS}, not {self.kind!r}")
        if not isinstance(self.model_types, tuple) or not all(isinstance(t, str) and t for t in self.model_types):
            raise ValueError(f"OnnxExport: model_types is a tuple of model types, not {self.model_types!r}")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    groups: tuple[GroupSpec, ...]
    # The family's norm eps, what the eps_power of a group without an eps of its own moves: one scope for the whole
    # model (`(EpsScope(("rms_norm_eps",)),)`), or one per part of a composite model (a language model and a tower
    # sharing its scale). A single scope without attrs says the code fixes every norm's eps: nothing can move it.
    eps: tuple[EpsScope, ...] = ()
    # Module attributes that hold a copy of that eps at run time (nn.LayerNorm.eps, RMSNorm.variance_epsilon).
    eps_module_attrs: tuple[str, ...] = ("eps", "variance_epsilon", "epsilon", "layer_norm_epsilon")
    unfixable: str = ""  # what no exact rescaling reaches in this family, in words
    # The norms compute x * (1 + w) (Gemma): llama.cpp's converter stores 1 + w, so the GGUF check
    # (halfsafe.export.gguf) compares the stored gains with 1 + w.
    one_plus_norm_gains: bool = False
    # The modules whose outputs a block adds to its residual stream, named from the block (`self_attn.o_proj`), one
    # set per kind of block the family's models hold (decoder and encoder layers, a vision tower's layers). For each
    # block the first set whose modules all exist is taken, so a set goes before any set it contains. In sandwich
    # and post-norm blocks the writers are the norms after the branches. The fp32-residual and clamp baselines
    # (halfsafe.runtime.fp16, halfsafe.runtime.baselines) hook them; the rescale itself does not read them.
    residual_writers: tuple[tuple[str, ...], ...] = ()
    notes: str = ""
    # Config field -> the size it takes in the shrunk random copy the probe runs on (core/shrink.py), for widths only
    # this family's configs name (multi-head latent attention, experts, per-layer inputs), in any of the model's
    # configs; merged over shrink.WIDTHS, the widths every family shares. A field already smaller keeps its value.
    shrink_widths: dict[str, int] = field(default_factory=dict)
    stress: StressHint = StressHint()  # for the stress models of tests/stress.py: see StressHint
    onnx: OnnxExport | None = None  # the ONNX exporter of an encoder or encoder-decoder family: see OnnxExport

    def __post_init__(self):
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name}: group names repeat: {names}")
        _check_family_eps(self)
        _check_writer_sets(self.name, self.residual_writers)
        _check_onnx(self)

    @property
    def onnx_model_types(self) -> tuple[str, ...]:
        """The model types `halfsafe export onnx` takes through the exporter `onnx` names (none without one)."""
        if self.onnx is None:
            return ()
        return self.onnx.model_types or self.model_types

    @property
    def eps_attrs(self) -> tuple[str, ...]:
        """The config fields that hold the family's eps (derived from `eps`)."""
        return tuple(dict.fromkeys(a for scope in self.eps for a in scope.attrs))


def _check_family_eps(family: Family) -> None:
    """The family's eps scopes do not contradict each other, and a group that moves the family's eps has one to move;
    groups that name the same eps of their own describe it the same way."""
    scopes = family.eps
    if not isinstance(scopes, tuple) or not all(isinstance(s, EpsScope) for s in scopes):
        raise ValueError(f"family {family.name}: eps is a tuple of EpsScope values, not {scopes!r}")
    if any(not s.attrs for s in scopes) and len(scopes) > 1:
        raise ValueError(f"family {family.name}: a scope without attrs (the code fixes every norm's eps) stands alone")
    if sum(not s.configs for s in scopes) > 1:
        raise ValueError(f"family {family.name}: more than one eps scope covers the whole model (configs=()): "
                         "name each part's config")
    if any(g.eps_power and g.eps is None for g in family.groups) and not any(s.attrs for s in scopes):
        raise ValueError(f"family {family.name}: a group moves the family's eps but `eps` names no config field holding "
                         "it (eps=(EpsScope((\"rms_norm_eps\",)),))")
    shared = {(c, a) for s in scopes for c in s.configs for a in s.attrs}
    own: dict[tuple, EpsScope] = {}
    for g in family.groups:
        if g.eps is None:
            continue
        field = (g.eps.configs[0], g.eps.attrs[0])
        if field in shared:
            raise ValueError(f"family {family.name}, group {g.name}: {'.'.join(field)} is the family's eps too (it would move twice)")
        if own.setdefault(field, g.eps) != g.eps:
            raise ValueError(f"family {family.name}: groups name {'.'.join(field)} with different scopes")


def _check_onnx(family: Family) -> None:
    """An OnnxExport, covering model types of the family's own."""
    if family.onnx is None:
        return
    if not isinstance(family.onnx, OnnxExport):
        raise ValueError(f"family {family.name}: onnx is an OnnxExport, not {family.onnx!r}")
    stray = [t for t in family.onnx.model_types if t not in family.model_types]
    if stray:
        raise ValueError(f"family {family.name}: onnx covers {stray}, which are not the family's model types "
                         f"{family.model_types}")


def _check_writer_sets(family: str, sets) -> None:
    """Each set a non-empty tuple of module names, and none hidden behind an earlier set it contains."""
    for i, names in enumerate(sets):
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"family {family}: residual_writers holds tuples of module names, not {names!r}")
        hidden = next((earlier for earlier in sets[:i] if set(earlier) <= set(names)), None)
        if hidden is not None:
            raise ValueError(f"family {family}: residual writer set {names} can never be chosen: {hidden}, listed "
                             "before it, matches every block it does (list the longer set first)")


def tied_head(model) -> bool:
    """The LM head is the input embedding (same tensor), so the head reads the residual scale."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def untied_head(model) -> bool:
    return not tied_head(model)


def has_param(template: str) -> Callable:
    """fn(model) -> bool: some parameter matches `template` (one `{i}` at most). For groups that exist only
    in some models of a family, e.g. the dense MLP pair of a model whose blocks are all mixture-of-experts."""
    rx = re.compile("^" + re.escape(template).replace(re.escape(BLOCK), r"\d+") + "$")

    def check(model) -> bool:
        prefix = f"{model.base_model_prefix}."
        bare = getattr(model, "base_model", None) is model
        return any(rx.match(prefix + n if bare else n) for n, _ in model.named_parameters())

    return check
