"""HeadroomCallback: float16 headroom of a model while the Trainer trains it, and an exact rescale when it runs low.

    trainer = Trainer(model, args, ...)
    HeadroomCallback(every_n_steps=50, rescale_below_bits=1.0).attach(trainer)
    trainer.train()

Every `every_n_steps` optimizer steps, the next forward pass is sampled: |x| max at each block output
(the residual stream) and at every other watched site, by hooks that remove themselves when that
forward ends. Headroom, log2(65504 / peak), is logged through the Trainer's logging (`logs` of the next
`on_log`, hence every reporter and `state.log_history`):

    headroom/layer_NN      lowest headroom in block NN (its output and every watched site inside it)
    headroom/residual_min  lowest headroom over block outputs
    headroom/min           lowest headroom over all watched sites (since the previous log)
    headroom/rescales      rescales applied so far (with rescaling on)

Below `warn_below_bits` a warning names the site. With `rescale_below_bits` set, the callback plans an
exact power-of-two rescale from the sampled peaks (the same planner as `convert`, with
`rescale_to_bits` of headroom) and applies it between two optimizer steps through a
`TrainingRescaler`: the optimizer keeps its state and trajectory (see coordinates.py). Sites that no
exact rescale moves (gate pre-activations) are only warned about; `halfsafe finetune` is the fallback.

Checkpoints: the rescaled weights are saved as usual; the optimizer state stays in the coordinates
the optimizer started in, and this callback's state (the applied exponents) is saved with the
Trainer's. Resume with `TrainingArguments(restore_callback_states_from_checkpoint=True)` so the map
is re-installed.
"""

from __future__ import annotations

import logging
import math

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.plan import movable, solve_peaks
from ..core.shrink import probe_governed
from ..core.sites import Site
from ..errors import HalfsafeError
from .coordinates import TrainingRescaler
from .headroom import WATCH_ALL, PeakSampler, headroom_bits, plain_fp32_forward

log = logging.getLogger("halfsafe.training")


class HeadroomCallback(TrainerCallback, ExportableState):
    def __init__(
        self,
        every_n_steps: int = 50,
        warn_below_bits: float = 1.0,
        rescale_below_bits: float | None = None,
        rescale_to_bits: float = 3.0,
        watch: str | list[str] = WATCH_ALL,
        log_layers: bool = True,
    ):
        if every_n_steps < 1:
            raise ValueError("every_n_steps must be at least 1")
        if rescale_below_bits is not None and rescale_to_bits <= rescale_below_bits:
            raise ValueError("rescale_to_bits must be above rescale_below_bits (or rescales would repeat)")
        self.every_n_steps = every_n_steps
        self.warn_below_bits = warn_below_bits
        self.rescale_below_bits = rescale_below_bits
        self.rescale_to_bits = rescale_to_bits
        self.watch = watch
        self.log_layers = log_layers
        self.applied_exponents: dict[str, int] = {}  # model = optimizer's coordinates moved by these
        self.eps: dict[str, float] = {}  # the norm eps that goes with them (resume check)
        self.history: list[dict] = []  # one entry per sampled step
        self.rescales: list[dict] = []
        self._pending: dict[str, float] = {}
        self._sampler: PeakSampler | None = None
        self._rescaler: TrainingRescaler | None = None
        self._governed: dict | None = None
        self._model = None

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, trainer) -> "HeadroomCallback":
        """Add this callback first, so every reporter (TensorBoard, W&B, ...) sees its values."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def state(self) -> dict:
        return {
            "args": {
                "every_n_steps": self.every_n_steps, "warn_below_bits": self.warn_below_bits,
                "rescale_below_bits": self.rescale_below_bits, "rescale_to_bits": self.rescale_to_bits,
                "watch": self.watch, "log_layers": self.log_layers,
            },
            "attributes": {"applied_exponents": dict(self.applied_exponents), "eps": dict(self.eps), "rescales": list(self.rescales)},
        }

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._model = model
        self._sampler = PeakSampler(model, self.watch)
        if self.rescale_below_bits is None and not self.applied_exponents:
            return
        try:
            self._rescaler = TrainingRescaler(model, optimizer)
        except HalfsafeError as e:
            log.warning("halfsafe: headroom is logged but not fixed during training: %s", e)
            self.rescale_below_bits = None
            return
        if self.applied_exponents:  # resumed: the weights carry them; the optimizer state does not
            family = self._rescaler.family
            now = config_eps(model.config)
            moved = all(now.get(k) == v for k, v in self.eps.items())
            self._rescaler.install_(self.applied_exponents, eps_already_moved=moved)
            log.info("halfsafe: resumed with rescale %s on top of the optimizer's coordinates (%s)", self.applied_exponents, family.name)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._sampler is not None and state.global_step % self.every_n_steps == 0:
            self._sampler.arm()

    def on_step_end(self, args, state, control, **kwargs):
        if self._sampler is None:
            return
        self._sampler.disarm()  # a step whose forward never ran (or raised) leaves nothing armed
        peaks = self._sampler.collect()
        if peaks:
            self._after_sample(state.global_step, peaks)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._pending or logs is None:
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        if self._sampler is not None:
            self._sampler.disarm()
        if self._rescaler is not None:
            self._rescaler.remove()
            self._rescaler = None

    # -- measuring and acting ------------------------------------------------------------------
    def _after_sample(self, step: int, peaks: dict[str, float]) -> None:
        sampler = self._sampler
        bits = {s: headroom_bits(p) for s, p in peaks.items()}
        per_layer: dict[int, float] = {}
        for s, b in bits.items():
            i = sampler.layer_of(s)
            if i is not None:
                per_layer[i] = min(per_layer.get(i, math.inf), b)
        outs = (str(Site(b, "out")) for b in sampler.blocks)
        block_outs = [bits[o] for o in outs if o in bits]
        worst = min(bits, key=bits.get)
        # where float16 first broke in this forward: the first overflowed site (inf or NaN) in module order, a block's
        # output left out when a site inside the block overflowed (the block's output comes after its insides)
        broken = [s for s in sampler.sites if bits.get(str(s)) == -math.inf]
        inner = [s for s in broken if not any(o.module.startswith(s.module + ".") for o in broken)]
        first = str(inner[0]) if inner else None
        entry = {"step": step, "min_bits": bits[worst], "min_site": worst, "layers": per_layer,
                 "residual_min_bits": min(block_outs, default=math.inf), "first_overflow": first}
        self.history.append(entry)
        pending = self._pending
        if self.log_layers:
            width = len(str(max(len(sampler.blocks) - 1, 0))) or 1
            for i, b in sorted(per_layer.items()):
                pending[f"headroom/layer_{i:0{max(width, 2)}d}"] = _num(b)
        pending["headroom/residual_min"] = _num(entry["residual_min_bits"])
        pending["headroom/min"] = min(pending.get("headroom/min", math.inf), _num(bits[worst]))
        if bits[worst] < self.warn_below_bits:
            what = "has overflowed float16" if bits[worst] == -math.inf else f"is {bits[worst]:.2f} bits from float16's limit"
            log.warning("halfsafe: at step %d, %s %s (|x| max %.4g)", step, worst, what, peaks[worst])
        if self.rescale_below_bits is not None and bits[worst] < self.rescale_below_bits:
            self._rescale(step, peaks, bits)
        if self._rescaler is not None:
            pending["headroom/rescales"] = float(len(self.rescales))

    def _group_map(self) -> dict | None:
        if self._governed is None:
            ids = self._sampler.input_ids
            if ids is None:
                vocab = self._model.config.get_text_config().vocab_size
                ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
            r = self._rescaler
            # on a shrunk random copy of the architecture (the model itself only where no copy can stand for it)
            with plain_fp32_forward(self._model), torch.no_grad():
                self._governed = probe_governed(self._model, r.family, r.groups, ids.to(self._model.device))
        return self._governed

    def _rescale(self, step: int, peaks: dict[str, float], bits: dict[str, float]) -> None:
        r = self._rescaler
        try:
            governed = self._group_map()
        except HalfsafeError as e:
            log.warning("halfsafe: no rescaling during training: %s", e)
            self.rescale_below_bits = None
            return
        # an overflowed peak (inf under fp16 autocast) gives no number to plan from: only the warning above
        finite = {s: p for s, p in peaks.items() if math.isfinite(p) and p > 0}
        exps = solve_peaks(r.groups, finite, governed, dict(self._model.named_parameters()), self.rescale_to_bits)
        moved = movable(governed)
        low = [s for s, b in bits.items() if b < self.rescale_below_bits]
        stuck = [s for s in low if s not in moved]
        if stuck:
            log.warning("halfsafe: no exact rescale moves %s (%.2f bits); `halfsafe finetune` lowers such peaks",
                        stuck[0], bits[stuck[0]])
        if not exps:
            return
        r.rescale_(exps)
        for k, v in exps.items():
            self.applied_exponents[k] = self.applied_exponents.get(k, 0) + v
        self.applied_exponents = {k: v for k, v in self.applied_exponents.items() if v}
        self.eps = config_eps(self._model.config)
        self.rescales.append({"step": step, "exponents": exps, "min_bits_before": bits[min(bits, key=bits.get)]})
        log.warning("halfsafe: at step %d, rescaled %s exactly (%s) to restore %.1f bits of float16 headroom",
                    step, r.family.name, _describe(exps), self.rescale_to_bits)


def config_eps(config) -> dict[str, float]:
    """Every eps-like float field of `config` and its sub-configs, by dotted name ("rms_norm_eps",
    "text_config.rms_norm_eps"): what a rescale may move, read one way for the resume check, the RL loop's record
    and vLLM's copy (halfsafe.training.rl.sync_vllm_eps)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if "eps" in str(k) and isinstance(v, float)})
        elif "eps" in key and isinstance(value, float):
            out[key] = value
    return out


def _num(x: float) -> float:
    """Loggers choke on inf: clamp to a large finite number of bits."""
    return float(max(min(x, 1e3), -1e3))


def _describe(exps: dict[str, int]) -> str:
    res = exps.get("residual")
    others = len([k for k in exps if k != "residual"])
    parts = ([f"residual x 2^{res}"] if res else []) + ([f"{others} pair group(s)"] if others else [])
    return ", ".join(parts)
