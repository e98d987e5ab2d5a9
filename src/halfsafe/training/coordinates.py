"""Rescaling a model that is being trained, without changing what the optimizer does.

A power-of-two rescale p' = S p (S per tensor, or per row of a fused tensor; `(1+w)` gains move as
1 + w' = S (1 + w)) leaves the model's function unchanged, and gradients follow exactly: g' = g / S.
Optimizers are not equivariant under it. SGD with momentum moves p' by lr g / S where it should move
it by S lr g; Adam's step is (almost) invariant to gradient scale, so a parameter scaled by S = 1/8
takes steps 8 times too large relative to its size; weight decay, eps, Adafactor's relative step and
LAMB's trust ratio each break differently. Transforming the state and hyperparameters per optimizer
(exp_avg / S, exp_avg_sq / S^2, a new param group with lr S, eps / S, weight decay / S, a scheduler
that knows about the new group ...) is possible for Adam and SGD with whole-tensor scales, but not
for per-row scales in one tensor, not for the affine `(1+w)` gains under weight decay, and not for
optimizers it does not know.

So `TrainingRescaler` never touches the optimizer state. The optimizer stays in the coordinates it
started in (the *reference* coordinates); the model lives in the rescaled ones; the map between
them is applied where the two meet:

- gradients, as they arrive (a tensor hook, before accumulation): g = S g'. Gradient accumulation,
  GradScaler unscaling, inf checks and gradient clipping all see reference gradients, so clipping
  decisions and the logged grad norm are those of the unrescaled run;
- parameters, around every `optimizer.step()` (step pre/post hooks): p = p' / S before the step,
  p' = S p after it. With a power of two these multiplications are exact, so the optimizer computes
  bit for bit what it would have computed without the rescale, for any optimizer.
  A `(1+w)` gain is not exactly invertible in floating point, so its reference value is kept
  (a small "shadow" copy: gains are vectors) and the model's value is recomputed from it.
  Both ways go through `core.rewrite` (`rescaled` / `unrescaled`), as every other rewrite of weights does.

The cost: two in-place multiplications per rescaled tensor per optimizer step, and the optimizer
state on disk is in reference coordinates: resuming needs the same map (`state_dict`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.groups import Group, expand
from ..core.rewrite import apply_exponents_, move_eps_, select_key, tensor_exponents
from ..core.weights import rescaled, unrescaled
from ..families import GAIN1P, MUL, Family, family_for


def innermost_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers (accelerate's AcceleratedOptimizer, ...)."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
        else:
            break
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch optimizer, got {type(optimizer).__name__}")
    return optimizer


def _add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + int(v)
    return {k: v for k, v in out.items() if v}


class TrainingRescaler:
    """Keeps `optimizer` in reference coordinates while `model` is rescaled by group exponents.

    `rescale_(exponents)` rescales the model now (between optimizer steps) and extends the map;
    `for_converted(model, optimizer, plan)` is for a model converted before its optimizer was made,
    so that it trains exactly as the unconverted model would (same learning rates mean the same thing).
    """

    def __init__(self, model: nn.Module, optimizer, family: Family | None = None, groups: list[Group] | None = None):
        self.model = model
        self.optimizer = innermost_optimizer(optimizer)
        self.family = family or family_for(model.config.model_type)
        self.groups = groups if groups is not None else expand(self.family, model)
        self.exponents: dict[str, int] = {}  # model coordinates = reference coordinates moved by these
        self._params = dict(model.named_parameters())
        self._optimized = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        self._maps: dict[str, list[tuple[str, int, object]]] = {}  # param -> [(kind, exponent, select)]
        self._shadows: dict[str, torch.Tensor] = {}  # (1+w) gains: their reference-coordinate values
        self._grad_hooks: dict[str, object] = {}
        self._step_hooks = [
            self.optimizer.register_step_pre_hook(lambda *_: self._to_reference()),
            self.optimizer.register_step_post_hook(lambda *_: self._to_model()),
        ]

    @classmethod
    def for_converted(cls, model, optimizer, plan) -> "TrainingRescaler":
        """`model` already carries `plan` (a `Plan`, or a dict of group exponents): the optimizer
        works in the unconverted model's coordinates from the first step."""
        r = cls(model, optimizer)
        r.install_(plan.exponents if hasattr(plan, "exponents") else plan)
        return r

    # -- the map ------------------------------------------------------------------------------
    def install_(self, exponents: dict[str, int], eps_already_moved: bool = True) -> None:
        """Record that the model *already* sits at `exponents` from the optimizer's coordinates
        (a converted model, or one resumed from a checkpoint); the weights are not touched.
        `eps_already_moved=False` moves the norm eps now (a model object whose config was not saved)."""
        self._check_names(exponents)
        if not eps_already_moved:
            move_eps_(self.model, self.family, self.groups, exponents)
        self.exponents = _add(self.exponents, exponents)
        self._rebuild(shadows_from_model=True)

    @torch.no_grad()
    def rescale_(self, exponents: dict[str, int]) -> None:
        """Rescale the model by `exponents` now; the optimizer's trajectory is unchanged."""
        self._check_names(exponents)
        exponents = {k: int(v) for k, v in exponents.items() if v}
        if not exponents:
            return
        for name, entries in tensor_exponents(self.groups, exponents).items():
            if any(kind == GAIN1P for kind, _, _ in entries) and name not in self._shadows and self._is_optimized(name):
                self._shadows[name] = self._params[name].detach().clone()  # still in reference coordinates
        apply_exponents_(self.model, self.family, self.groups, exponents)
        self.exponents = _add(self.exponents, exponents)
        self._rebuild(shadows_from_model=False)

    def _check_names(self, exponents: dict[str, int]) -> None:
        unknown = set(exponents) - {g.name for g in self.groups}
        if unknown:
            raise ValueError(f"no such rescaling group(s) in this model: {', '.join(sorted(unknown)[:5])}")

    def _is_optimized(self, name: str) -> bool:
        return id(self._params[name]) in self._optimized

    @torch.no_grad()
    def _rebuild(self, shadows_from_model: bool) -> None:
        maps = {n: e for n, e in tensor_exponents(self.groups, self.exponents).items() if self._is_optimized(n)}
        for name, entries in maps.items():
            p = self._params[name]
            gain = [(k, e, s) for k, e, s in entries if k == GAIN1P]
            if gain:
                (_, e, _), = gain
                if name not in self._shadows and shadows_from_model:
                    # w_ref = (1 + w') / S - 1: exact whenever w' was computed from w_ref by S (no rounding)
                    self._shadows[name] = rescaled(p.detach().clone(), [(GAIN1P, -e, None)])
                # one rounding from the reference value, however many rescales came before
                rescaled(p.data.copy_(self._shadows[name]), gain)
            if _key(self._maps.get(name)) != _key(entries):
                old = self._grad_hooks.pop(name, None)
                if old is not None:
                    old.remove()
                self._grad_hooks[name] = p.register_hook(_grad_to_reference(entries))
        for name in set(self._maps) - set(maps):  # a rescale that cancelled an earlier one
            self._grad_hooks.pop(name).remove()
            shadow = self._shadows.pop(name, None)
            if shadow is not None:
                self._params[name].data.copy_(shadow)
        self._maps = maps

    # -- around each optimizer step ------------------------------------------------------------
    @torch.no_grad()
    def _to_reference(self) -> None:
        for name, entries in self._maps.items():
            unrescaled(self._params[name].data, entries, self._shadows.get(name))

    @torch.no_grad()
    def _to_model(self) -> None:
        for name, entries in self._maps.items():
            p = self._params[name]
            if name in self._shadows:
                self._shadows[name].copy_(p.data)  # the step's result, in reference coordinates
            rescaled(p.data, entries)

    # -- bookkeeping ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"family": self.family.name, "exponents": dict(self.exponents)}

    def remove(self) -> None:
        """Detach every hook (the model keeps its weights; the optimizer must not step again)."""
        for h in self._step_hooks:
            h.remove()
        for h in self._grad_hooks.values():
            h.remove()
        self._step_hooks, self._grad_hooks, self._maps = [], {}, {}


def _key(entries) -> list | None:
    return None if entries is None else [(k, e, select_key(s)) for k, e, s in entries]


def _grad_to_reference(entries):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # d p'/d p = S for both kinds: g_ref = S g'
        return rescaled(grad.clone(), [(MUL, e, select) for _, e, select in entries])

    return hook

