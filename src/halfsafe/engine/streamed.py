"""A model whose weights stay in the checkpoint's shards and are loaded one unit at a time.

The model is built on the meta device (buffers real, so rotary tables and embedding scales are what transformers
computes); every *unit* (each repeated block, and each module outside the blocks that owns parameters: embeddings,
final norm, head, a vision tower's patch embedding) gets a pre-hook that loads its parameters from the shards, in
`dtype` on `device`, rescaled as the current rescale table says, and a hook that frees them again. The model's own
forward then runs unchanged, for every architecture, holding one unit's weights (plus whatever `cache_bytes`
allows to stay) and the activations of one sample. Several samples can pass each unit together, so that it is read
once for all of them (`engine.pipeline.in_step`: the calibration scan, verify's forward passes).

The Streamed is the model's `core.weights.Weights` (`attach` holds it there): a rescale (`halfsafe.core.rewrite`)
changes what the next load computes, never the stored tensors: `(1+w)` gains are computed afresh from the stored
values each time, so trying and undoing a plan leaves nothing behind.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from ..core.rewrite import merge_tables
from ..core.sites import Hooks, find_blocks
from ..core.weights import WEIGHTS_ATTR, hold, rescaled
from ..errors import HalfsafeError
from .islands import KEEP_FP32_BUFFERS, strict_fp32_pattern
from .pool import Pool
from .shards import Shards, row_spans, rows_per_read
from .wide import WideWeight

WIDE_BYTES = 128 << 20


@dataclass
class Slot:
    """One place a parameter sits: `module._parameters[attr]` (a tied weight has two slots, one name)."""

    module: nn.Module
    attr: str


@dataclass
class Streamed:
    model: PreTrainedModel
    shards: Shards
    key_of: dict[str, str]  # canonical parameter name -> checkpoint key
    units: dict[str, list[tuple[Slot, str]]]  # unit module name -> its parameter slots and their canonical names
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    cache_bytes: int = 0  # loaded tensors kept beyond the running unit (0: only the running unit's)
    rescale: dict[str, list] = field(default_factory=dict)  # param -> [(kind, exponent, select)], see rewrite
    loads: int = 0  # tensors (or slices of wide ones) read from the shards so far (tests count them)
    wide_bytes: int = WIDE_BYTES  # matrices larger than this are read a slice at a time (see engine.wide)
    _placeholders: dict[str, nn.Parameter] = field(default_factory=dict)
    _cache: "OrderedDict[str, torch.Tensor]" = field(default_factory=OrderedDict)
    _handles: Hooks = field(default_factory=Hooks)
    _strict: object = None
    stem: list[str] = field(default_factory=list)  # units outside the blocks, held for a whole forward (see attach)
    _depth: int = 0
    _loaded: set = field(default_factory=set)  # units whose weights are in their modules now
    _gate: object = None  # an in_step pass's (engine.pipeline.Gate) while one runs

    def __post_init__(self) -> None:
        if self.shards.pool is None:  # each block's reads reuse what the block before let go (engine.pool)
            self.shards.pool = Pool()

    # ----- what a unit sees
    def tensor(self, name: str) -> torch.Tensor:
        """The parameter `name` as the model computes with it now: stored value, rescaled, in `dtype`, on `device`
        (a `WideWeight`, read a slice at a time, when it is larger than `wide_bytes`: see `_is_wide`)."""
        t = self._cache.get(name)
        if t is not None:
            self._cache.move_to_end(name)
            return t
        key = self.key_of[name]
        if self._is_wide(name):
            t = self.wide(name)
        else:
            self.loads += 1
            t = self._prepared(name, lambda dtype: self.shards.load(key, dtype), reusable=True)
        self._cache[name] = t
        return t

    def wide(self, name: str) -> WideWeight:
        """A stand-in for the wide parameter `name` (see `_is_wide`): its shape, dtype and device, its values read a
        slice at a time (engine.wide). Holds nothing, and is not cached."""
        return WideWeight(self, name, self.shards.shape(self.key_of[name]), self._dtype_of(name), self.device)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of what `tensor(name)` computes with (a wide weight's values, a slice at a time). Each
        forward of an `in_step` pass reads its own: forwards waiting inside a product would each hold its output."""
        self.loads += 1
        return self._prepared(name, lambda dtype: self.shards.load_rows(self.key_of[name], start, stop, dtype))

    def gather(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The rows `rows` (sorted, distinct) of what `tensor(name)` computes with."""
        self.loads += 1
        return self._prepared(name, lambda dtype: self.shards.load_index(self.key_of[name], rows.cpu(), dtype))

    def _dtype_of(self, name: str) -> torch.dtype:
        return torch.float32 if self._strict is not None and self._strict.search(name) else self.dtype

    def _prepared(self, name: str, read, reusable: bool = False) -> torch.Tensor:
        """`read(dtype)` (stored values) rescaled and cast as the model computes with them. Rescaled in float32;
        otherwise read straight into the compute dtype: the same single rounding, without a float32 copy on the way.
        `reusable`: a whole tensor's read, whose float32 copy goes back to the pool for the next whole read of its size
        (slices of rows are never read from the pool: given to it, they would only pile up until a miss)."""
        from torch.utils._python_dispatch import _disable_current_modes

        entries = self.rescale.get(name, ())
        dtype = self._dtype_of(name)
        # reading weights is not the model's computation: a dispatch mode watching the forward (verify's
        # activation-bytes counter) must not count them, even when a wide weight is read during the forward
        with _disable_current_modes():
            t = rescaled(read(torch.float32 if entries or dtype == torch.float32 else dtype), entries)
            out = t.to(self.device, dtype)
            if out is not t and reusable:
                self._let_go(t)  # the float32 read, cast: the next read of its size reuses it
            return out

    def _is_wide(self, name: str) -> bool:
        """A matrix bigger than `wide_bytes` (and than what the cache may hold) is read a slice at a time, when its
        rescales act on every element alike (a rescale of some rows or columns needs the whole tensor)."""
        shape = self.shards.shape(self.key_of[name])
        if len(shape) != 2 or not self.rescaled_alike(name):
            return False
        size = shape[0] * shape[1] * torch.empty((), dtype=self._dtype_of(name)).element_size()
        return size > max(self.wide_bytes, self.cache_bytes)

    def weight_bytes(self) -> int:
        """What every parameter takes in the dtype the model computes in (each parameter once, tied ones too)."""
        return sum(math.prod(self.shards.shape(self.key_of[n])) * self._dtype_of(n).itemsize for n in self.key_of)

    def rescaled_alike(self, name: str) -> bool:
        """Every rescale of `name` acts on each element alike, so any block of its rows can be rescaled on its own."""
        return all(select is None for _, _, select in self.rescale.get(name, ()))

    def original(self, name: str) -> torch.Tensor:
        """The stored parameter in float32, untouched by any rescale (for measuring weights)."""
        return self.shards.load(self.key_of[name], torch.float32)

    def _onload(self, unit: str) -> None:
        if unit in self._loaded:
            return
        if self._gate is not None and unit not in self.stem and self._gate.wait(("unit", unit)):
            return  # loaded once for all the forwards of an in_step pass
        from torch.utils._python_dispatch import _disable_current_modes

        # loading is not the model's computation: a dispatch mode watching the forward (verify's activation-bytes
        # counter) sees the weights as an in-memory model's, made before the forward started
        with self.shards, _disable_current_modes():
            for slot, name in self.units[unit]:
                t = self.tensor(name)
                slot.module._parameters[slot.attr] = t if isinstance(t, WideWeight) else nn.Parameter(t, requires_grad=False)
        self._loaded.add(unit)
        self._evict()

    def _offload(self, unit: str) -> None:
        if self._depth and unit in self.stem:
            return  # held until the model's forward ends
        if self._gate is not None and self._gate.holds(unit):
            return  # other forwards of the pass have yet to run it
        for slot, name in self.units[unit]:
            slot.module._parameters[slot.attr] = self._placeholders[name]
        self._loaded.discard(unit)
        self._evict()

    def _evict(self) -> None:
        """Drop cached tensors no loaded unit holds, oldest first, down to `cache_bytes`."""
        keep = {name for u in self._loaded for _, name in self.units[u]}
        size = sum(_held_bytes(t) for n, t in self._cache.items() if n not in keep)
        for name in list(self._cache):
            if size <= self.cache_bytes:
                break
            if name not in keep:
                t = self._cache.pop(name)
                size -= _held_bytes(t)
                self._let_go(t)

    def _let_go(self, t) -> None:
        if not isinstance(t, WideWeight) and self.shards.pool is not None:
            self.shards.pool.give(t)

    def clear_cache(self) -> None:
        """Drop every loaded tensor (what nothing else holds goes back to the pool)."""
        while self._cache:
            self._let_go(self._cache.popitem()[1])

    # ----- changing what loads compute
    def set_rescale(self, table: dict[str, list]) -> None:
        self._require_idle()
        self.rescale = {k: list(v) for k, v in table.items() if v}
        self.clear_cache()

    # ----- the Weights core reads and changes (core.weights)
    def values(self) -> "_Weights":
        """Each parameter's current value, read from the shards on access (a block of rows at a time by `blocks`)."""
        return _Weights(self)

    def rescale_(self, table: dict[str, list]) -> None:
        self.set_rescale(merge_tables(self.rescale, table))

    def snapshot(self, names) -> "Callable[[], None]":
        """Nothing to keep: the stored values never change, and a rescale and its inverse cancel in the table."""
        return lambda: None

    @contextmanager
    def held(self):
        """The stem stays loaded across several forwards (see `attach`)."""
        self._enter_model()
        try:
            yield
        finally:
            self._exit_model()

    def _require_idle(self) -> None:
        if self._loaded:
            raise RuntimeError(f"cannot change a streamed model's weights while {sorted(self._loaded)[0]} is loaded")

    def set_dtype(self, dtype: torch.dtype) -> dict:
        """Compute in `dtype` from now on: placeholders report it, floating buffers are cast (rotary tables and
        what transformers keeps in float32 stay). Returns what `restore_dtype` needs to undo it exactly."""
        self._require_idle()
        saved = {"dtype": self.dtype, "config": getattr(self.model.config, "dtype", None), "buffers": {}}
        for name, p in self._placeholders.items():
            if not (self._strict is not None and self._strict.search(name)):
                p.data = torch.empty(p.shape, dtype=dtype, device="meta")
        for module_name, module in self.model.named_modules():
            for attr, b in list(module._buffers.items()):
                full = f"{module_name}.{attr}" if module_name else attr
                if b is None or not b.is_floating_point() or full.endswith(KEEP_FP32_BUFFERS) or b.dtype == dtype:
                    continue
                saved["buffers"][(id(module), attr)] = (module, b)
                module._buffers[attr] = b.to(dtype)
        self.dtype = dtype
        self.model.config.dtype = dtype
        self.clear_cache()
        return saved

    def restore_dtype(self, saved: dict) -> None:
        for name, p in self._placeholders.items():
            p.data = torch.empty(p.shape, dtype=saved["dtype"] if not (self._strict is not None and self._strict.search(name))
                                 else p.dtype, device="meta")
        for (_, attr), (module, b) in saved["buffers"].items():
            module._buffers[attr] = b
        self.dtype = saved["dtype"]
        self.model.config.dtype = saved["config"]
        self.clear_cache()

    def _enter_model(self) -> None:
        self._depth += 1
        if self._depth == 1:
            for unit in self.stem:
                self._onload(unit)

    def _exit_model(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            for unit in self.stem:
                self._offload(unit)

    def attach(self) -> "Streamed":
        """Each unit loads around its own forward. The units outside the blocks (embeddings, head, norms: the stem)
        load when the model's (or its base model's) forward starts and stay until it ends: some forwards read a
        weight outside its module (Gemma 4 reads the pad token's embedding row directly)."""
        roots = {id(m): m for m in (self.model, getattr(self.model, "base_model", None)) if m is not None}
        for root in roots.values():
            self._handles.add_pre(root, lambda m, a: self._enter_model())
            self._handles.add_post(root, lambda m, a, o: self._exit_model(), always_call=True)
        for unit in self.units:
            module = self.model.get_submodule(unit)
            self._handles.add_pre(module, lambda m, a, u=unit: self._onload(u))
            self._handles.add_post(module, lambda m, a, o, u=unit: self._offload(u), always_call=True)
        hold(self.model, self)
        return self

    def detach(self) -> None:
        self._handles.remove()


def _held_bytes(t: torch.Tensor) -> int:
    return 0 if isinstance(t, WideWeight) else t.numel() * t.element_size()


def streamed_of(model: nn.Module) -> Streamed | None:
    """The Streamed behind `model`, or None for an ordinary model whose weights are all in memory."""
    held = getattr(model, WEIGHTS_ATTR, None)
    return held if isinstance(held, Streamed) else None


def untie_stored_apart(model: PreTrainedModel, shards: Shards) -> list[str]:
    """Untie what from_pretrained unties: a pair the config ties (`all_tied_weights_keys`, target -> source) whose
    two tensors the checkpoint both stores, with different values (a T5 v1.1 checkpoint with its own lm_head under
    a config that says `tie_word_embeddings: true`; transformers warns "we will NOT tie them"). The target gets
    its own parameter, so the skeleton is the model transformers loads. Returns the untied targets."""
    untied = []
    for target, source in list(getattr(model, "all_tied_weights_keys", {}).items()):
        p = model.get_parameter(target)
        stored = [_stored_key(model, shards, n, p.shape) for n in (target, source)]
        if None in stored or _same_stored(shards, *stored):
            continue
        owner, _, attr = target.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
        model.all_tied_weights_keys.pop(target)
        untied.append(target)
    return untied


def _stored_key(model: PreTrainedModel, shards: Shards, name: str, shape) -> str | None:
    found = [k for k in (name, saved_name(model, name, shape)) if k is not None and k in shards]
    return next((k for k in found if tuple(shards.shape(k)) == tuple(shape)), None)


def _same_stored(shards: Shards, a: str, b: str) -> bool:
    """Two stored tensors hold the same values (compared a block of rows at a time)."""
    if a == b:
        return True
    shape = shards.shape(a)
    if shape != shards.shape(b) or shards.dtype(a) != shards.dtype(b):
        return False
    if len(shape) < 2:
        return torch.equal(shards.load(a), shards.load(b))
    step = rows_per_read(shape, shards.dtype(a).itemsize)
    return all(torch.equal(shards.load_rows(a, i, j), shards.load_rows(b, i, j)) for i, j in row_spans(shape[0], step))


def checkpoint_keys(model: PreTrainedModel, shards: Shards) -> dict[str, str | None]:
    """parameter name -> the checkpoint key holding it, or None where transformers renames, merges or splits the
    stored tensors on load in a way one key cannot hold (per-expert MoE weights): such checkpoints are loaded whole,
    by transformers itself."""
    bare = bool(getattr(model, "base_model_prefix", "")) and getattr(model, "base_model", None) is model
    aliases: dict[int, list[str]] = {}  # a tied parameter is read from whichever of its names the checkpoint stores
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    keys = {}
    for name, p in model.named_parameters():
        candidates = [k for alias in aliases[id(p)] for k in (alias, saved_name(model, alias, p.shape))]
        if bare:
            candidates.append(f"{model.base_model_prefix}.{name}")  # a bare base model read from a checkpoint saved with its head
        keys[name] = next((k for k in candidates if k is not None and k in shards and tuple(shards.shape(k)) == tuple(p.shape)), None)
    return keys


def saved_name(model: PreTrainedModel, name: str, shape) -> str | None:
    """The name transformers' save_pretrained gives parameter or buffer `name` of `shape` (older layouts keep older
    names: GPT-NeoX's `embed_out`, Gemma 3's `language_model.model.*`); None when saving splits or merges it
    (per-expert MoE weights)."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {name: torch.empty(tuple(shape), device="meta")})
    if len(out) != 1:
        return None
    (key, value), = out.items()
    return key if tuple(value.shape) == tuple(shape) else None


def skeleton(config: PretrainedConfig, cls) -> PreTrainedModel:
    """`cls(config)` on the meta device, float32, its weights tied as the config says: no memory, no checkpoint."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=torch.float32)
    model.tie_weights()
    return model


def split_on_save(model: PreTrainedModel) -> list[str]:
    """The parameters transformers' save_pretrained splits or merges (per-expert MoE weights: one stored tensor per
    expert, merged again on load): in a checkpoint it saved, no one key holds them (`checkpoint_keys`)."""
    return [name for name, p in model.named_parameters() if saved_name(model, name, p.shape) is None]


def loads_whole(config: PretrainedConfig, cls) -> bool:
    """Whether a checkpoint transformers saved of `cls(config)` is loaded whole, not streamed: `build` refuses it
    because some parameter is split or merged on save (`split_on_save`), and loading falls back to transformers."""
    return bool(split_on_save(skeleton(config, cls)))


def build(config: PretrainedConfig, cls, shards: Shards, device: str | torch.device = "cpu", cache_bytes: int = 0) -> Streamed:
    """The meta skeleton of `cls(config)` with its units hooked to load from `shards`. Raises HalfsafeError with
    the reason when the checkpoint's layout needs transformers' own loader (see `checkpoint_keys`)."""
    model = skeleton(config, cls)
    untie_stored_apart(model, shards)
    model.eval()
    keys = checkpoint_keys(model, shards)
    missing = [n for n, k in keys.items() if k is None]
    if missing:
        raise HalfsafeError(f"cannot stream this checkpoint: {len(missing)} parameter(s) not stored under their own name "
                            f"(e.g. {missing[0]})")
    params = dict(model.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    _load_persistent_buffers(model, shards)
    _buffers_to(model, torch.device(device))
    units = _units(model, by_id)
    s = Streamed(model, shards, keys, units, torch.device(device),
                 cache_bytes=cache_bytes)
    s._placeholders = dict(params)
    blocks = set(find_blocks(model))
    s.stem = [u for u in units if u not in blocks]
    s._strict = strict_fp32_pattern(model)
    return s.attach()


def _units(model: nn.Module, by_id: dict[int, str]) -> dict[str, list[tuple[Slot, str]]]:
    """Blocks, then every other module that owns parameters directly (outside all blocks)."""
    blocks = find_blocks(model)
    units: dict[str, list[tuple[Slot, str]]] = {}
    for b in blocks:
        units[b] = [(Slot(m, a), by_id[id(p)]) for name, m in model.get_submodule(b).named_modules()
                    for a, p in m._parameters.items() if p is not None]
    inside = re.compile("|".join(re.escape(b) + r"(\.|$)" for b in blocks)) if blocks else None
    for name, m in model.named_modules():
        if inside is not None and inside.match(name):
            continue
        own = [(Slot(m, a), by_id[id(p)]) for a, p in m._parameters.items() if p is not None]
        if own:
            units[name] = own
    return units


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Buffers (rotary tables, scales) live where the units compute; parameters stay on meta until loaded."""
    if device.type == "cpu":
        return
    for module in model.modules():
        for attr, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[attr] = b.to(device)


def _load_persistent_buffers(model: nn.Module, shards: Shards) -> None:
    """Buffers the checkpoint stores (position ids, some scales) as from_pretrained would set them."""
    names = {n for n, _ in model.named_buffers()}
    for key in shards.keys():
        if key in names:
            module_name, _, attr = key.rpartition(".")
            module = model.get_submodule(module_name)
            b = module._buffers[attr]
            module._buffers[attr] = shards.load(key, torch.float32 if b.is_floating_point() else None).to(b.dtype)


class _Weights(dict):
    """name -> float32 value of each parameter as the model holds it now (stored value, current rescale), read from the
    shards on access: measuring every weight of a 27B model holds one at a time."""

    def __init__(self, streamed: Streamed):
        super().__init__()
        self._s = streamed

    def __getitem__(self, name: str) -> torch.Tensor:
        return rescaled(self._s.original(name), self._s.rescale.get(name, ()))

    def __contains__(self, name: object) -> bool:
        return name in self._s.key_of

    def blocks(self, name: str):
        """The same value a block of rows at a time (a 262k-token embedding is 0.7 GB in float32)."""
        key = self._s.key_of[name]
        shape = self._s.shards.shape(key)
        if len(shape) < 2 or not self._s.rescaled_alike(name):
            yield self[name]
            return
        for a, b in row_spans(shape[0], rows_per_read(shape, 4)):  # float32
            yield rescaled(self._s.shards.load_rows(key, a, b, torch.float32), self._s.rescale.get(name, ()))


@contextmanager
def resident(model: nn.Module, cache_bytes: int):
    """Within: a streamed model keeps the tensors it loads, up to `cache_bytes` of them beyond the running unit, so
    that repeated forwards (greedy generation: one per token) read each unit once instead of once per forward. The
    same load path, with the cache allowed to hold what fits; freed on leaving. A no-op for an in-memory model, and
    where the model's weights do not all fit in `cache_bytes`: forwards read the units in the same order every time,
    so a cache that holds less than all of them keeps none until it is needed again (the oldest goes first), and a
    larger cache would only make matrices read whole that are cheaper read a slice at a time (`_is_wide`)."""
    s = streamed_of(model)
    if s is None or s.weight_bytes() > cache_bytes:
        yield
        return
    saved = s.cache_bytes
    s.cache_bytes = max(saved, cache_bytes)
    try:
        yield
    finally:
        s.cache_bytes = saved
        s._evict()

