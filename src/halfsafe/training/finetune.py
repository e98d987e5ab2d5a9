"""The fallback where no exact rescale reaches: a short fine-tune that lowers the remaining peaks.

Gate pre-activations (SiLU/GELU inputs) and the like are not homogeneous: no power-of-two rescale
moves them without changing the model. `finetune_below_threshold` trains the model to stay close to
its original (KL distillation on the original's logits: the teacher is a frozen float32 copy) while
a squared hinge penalises every |x| above a target at the watched sites (all sites whose float32
peak exceeds the threshold):

    loss = KL(teacher || student) per token + w * sum_sites sum_x relu(|x| / hinge - 1) / tokens
    target = threshold * 2**-margin_bits, hinge = target * 2**-0.25

(the hinge sits a little under the target: a penalty that starts at the target only approaches it;
it is linear, a constant push: a squared hinge fades near the hinge and the KL term stalls it there).

Only the module around each watched site trains (`train="parent"`: for a gate projection, the MLP
holding it: gate, up and down; "blocks": the whole block; "all": everything), with a relative step: each tensor's learning rate is lr x its RMS, so a blown-up gate (RMS 1e3) and an
ordinary projection (RMS 1e-2) both move by about lr of their size per step.

It stops `polish_steps` after every watched peak first went below the target on every sample
(confirmed by a full float32 scan of every site; a site that newly crosses the threshold joins the
watched ones), once that still holds; or after `steps`. The polish lets the KL recover: the push that
brought the peaks down overshoots, and the hinge holds them while the distillation pulls back. With a state file it saves the trained tensors and the optimizer every `save_every` steps
and resumes from there.

Any model kind with output logits trains the same way: every forward pass goes through forward.model_inputs,
so an encoder-decoder (T5) is teacher-forced on the sample (its decoder reads the text shifted right, as in the
scan) and the KL compares the decoder's logits; an encoder with a head (BERT for masked LM) compares its head's.
A model without a head (BertModel, T5EncoderModel, an embedding model) has no logits to stay close to: it is
refused before anything runs (`require_logits`).

`finetune_checkpoint` is the whole pipeline behind `halfsafe finetune`: load, exact rescale first
(`make_fp16_safe(..., allow_unfixable=True)`), fine-tune what is left, save an ordinary fp16 checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from ..convert import ConversionReport, rescale_with
from ..core.forward import model_inputs
from ..core.sites import Site, block_of, find_blocks, within
from ..core.stats import SiteCollector
from ..engine.fp16_arith import resolve
from ..errors import HalfsafeError
from ..files.filetypes import input_file
from ..io import owned
from ..io.report import Finetuned, FinetuneReport, Record
from ..job import Job, Options, Output, run
from ..requests import FINETUNE_TEXT, EngineOptions, FinetuneRequest, TextOptions
from ..requests.finetune import HINGE_BITS_UNDER_TARGET, TRAIN_MODES, FinetuneConfig  # noqa: F401  (their home: requests)
from ..scan import check_fp16, collect

STATE_VERSION = 1
STATE_NAME = "finetune_state.pt"
_MIN_RMS = 1e-3  # floor for the relative step of tensors that are (nearly) zero


# -- hooks --------------------------------------------------------------------------------------
class _Penalty(SiteCollector):
    """Differentiable hinge at the watched sites, and their peaks, for one forward pass: the tensors keep their
    graph (nothing here detaches what the loss uses)."""

    def __init__(self, model: nn.Module, sites: list[str], hinge: float):
        super().__init__(model)
        self.hinge = hinge
        self.total: torch.Tensor | None = None
        self.peaks: dict[str, float] = {}
        for site in sites:
            where = Site.parse(site)
            # no hook sees an expert's product (inside its fused module): its module's output stands for it, every
            # call of a module is penalised under the one site
            self.watch(Site(where.module, "in" if where.kind == "in" else "out"), name=site)

    def record(self, site: str, module: nn.Module, t: torch.Tensor) -> None:
        a = t.abs().float()
        self.peaks[site] = max(self.peaks.get(site, 0.0), float(a.detach().max()))
        if not t.requires_grad:
            return
        term = F.relu(a / self.hinge - 1.0).sum()
        self.total = term if self.total is None else self.total + term

    def reset(self) -> None:
        self.total, self.peaks = None, {}


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits the KL compares, from the same inputs the scan gives the model (teacher-forced decoder)."""
    return model(**model_inputs(model, ids), use_cache=False).logits


def _head_classes(config) -> list[str]:
    """Model classes with a language-model head for this config (the fix a headless model needs)."""
    import transformers

    found = []
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            found.append(mapping[type(config)].__name__)
    return found


@torch.no_grad()
def require_logits(model: nn.Module, sample: torch.Tensor) -> None:
    """Fail now, in one line, if `model` gives no logits to distil against (a model without a head)."""
    out = model(**model_inputs(model, sample[:, :2]), use_cache=False)
    if getattr(out, "logits", None) is None:
        heads = _head_classes(model.config)
        fix = f"load it as {' or '.join(heads)}" if heads else "load it with a head that outputs logits"
        raise HalfsafeError(f"{type(model).__name__} has no output logits for the fine-tune to stay close to: {fix} "
                            "(the class named in config.json's \"architectures\")")


def _kl(teacher_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) per token, in nats."""
    s = F.log_softmax(logits.float(), dim=-1).reshape(-1, logits.shape[-1])
    t = teacher_logp.reshape(-1, logits.shape[-1])
    return F.kl_div(s, t, log_target=True, reduction="sum") / s.shape[0]


@torch.no_grad()
def _teacher_logp(teacher: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(_logits(teacher, ids).float(), dim=-1)


# -- what trains ----------------------------------------------------------------------------------
def _owner(site: str, blocks: list[str], mode: str) -> str:
    """The module whose parameters train for `site`: its block ("blocks"), or ("parent") the module
    around the site's module, never wider than the block (a block's own output trains the block)."""
    module = Site.parse(site).module
    block = block_of(module, blocks)
    if mode == "blocks" or module == block:
        return block or module
    parent = module.rsplit(".", 1)[0] if "." in module else module
    if block is None:  # outside the blocks (a head, an embedding): the module itself
        return module
    return parent if within(parent, block) else block


def _trainable(model: nn.Module, watched: list[str], mode: str) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    if mode == "all":
        return names
    blocks = find_blocks(model)
    owners = {_owner(s, blocks, mode) for s in watched}
    chosen = [n for n in names if any(n.startswith(o + ".") for o in owners)]
    lonely = [o for o in owners if not any(n.startswith(o + ".") for n in names)]
    if lonely:  # a parameter-free module outside the blocks (an activation): let everything train
        return names
    return chosen


def _param_groups(params: dict[str, nn.Parameter], names: list[str], lr: float) -> list[dict]:
    groups = []
    for n in names:
        p = params[n]
        rms = float(p.detach().float().pow(2).mean().sqrt()) if p.numel() else 0.0
        groups.append({"params": [p], "lr": lr * max(rms, _MIN_RMS), "name": n})
    return groups


# -- the state file -----------------------------------------------------------------------------
def _fingerprint(model: nn.Module, samples: list[torch.Tensor], config: FinetuneConfig) -> dict:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.cpu().numpy().tobytes())
    cfg = {k: v for k, v in asdict(config).items() if k not in ("steps", "save_every", "polish_steps")}
    with torch.no_grad():  # the weights the fine-tune starts from (another model of the same shape must not resume)
        weights = sum(float(p.detach().double().abs().sum()) for p in model.parameters())
    return {"model_type": model.config.model_type, "parameters": sum(p.numel() for p in model.parameters()),
            "weights": f"{weights:.12e}", "samples": h.hexdigest()[:16], **cfg}


def _save_state(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)


def _load_state(path: Path, fingerprint: dict) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise HalfsafeError(f"could not read the fine-tune state {path} ({str(e).splitlines()[0][:120]}): delete it or pass --restart") from None
    if data.get("version") != STATE_VERSION:
        raise HalfsafeError(f"{path} was written by another halfsafe version: pass --restart to start over")
    old = data.get("fingerprint", {})
    diff = [k for k in sorted(set(old) | set(fingerprint)) if old.get(k) != fingerprint.get(k)]
    if diff:
        k = diff[0]
        raise HalfsafeError(f"{path} belongs to a run with other settings ({k}: {old.get(k)!r} there, {fingerprint.get(k)!r} now): "
                            "pass the same settings, or --restart to discard it")
    return data


# -- the loop -----------------------------------------------------------------------------------
def _max_watched(sites: dict, watched: list[str]) -> float:
    return max((sites[s].abs_max for s in watched if s in sites), default=0.0)


def finetune_below_threshold(
    model: nn.Module,
    samples: list[torch.Tensor],
    config: FinetuneConfig | None = None,
    teacher: nn.Module | None = None,
    progress: bool = True,
    state_file: str | Path | None = None,
) -> FinetuneReport:
    """Fine-tune `model` (float32, in place) until every watched |x| is below `config.target` or
    `config.steps` run out. `teacher`: the frozen original (default: a copy of `model` as it is now)."""
    config = config or FinetuneConfig()
    config.check()
    if not samples:
        raise HalfsafeError("no samples to fine-tune on: pass --text with some text")
    require_logits(model, samples[0])
    torch.manual_seed(config.seed)
    teacher = teacher if teacher is not None else copy.deepcopy(model)
    teacher.eval().requires_grad_(False)
    target, threshold = config.target, config.threshold

    sites = collect(model, samples, progress=False)
    bad = [s for s, st in sites.items() if not math.isfinite(st.abs_max)]
    if bad:
        raise HalfsafeError(f"the model computes inf/NaN in float32 at {bad[0]}: it cannot be fine-tuned into range")
    watched = [s for s, st in sites.items() if st.abs_max > threshold]
    peaks_before = {s: sites[s].abs_max for s in watched}
    fingerprint = _fingerprint(model, samples, config)
    state_path = Path(state_file) if state_file else None
    state = _load_state(state_path, fingerprint) if state_path else None
    if state is not None:
        watched = list(state["watched"])
        peaks_before = dict(state["peaks_before"])
    if not watched:
        top = max(sites.values(), key=lambda s: s.abs_max)
        return FinetuneReport(0, "nothing above the threshold: no fine-tune needed", threshold, target, [], [], {}, {},
                              top.abs_max, top.name, 0.0, True)

    params = dict(model.named_parameters())
    trainable = list(state["trainable"]) if state else _trainable(model, watched, config.train)
    requires = {n: p.requires_grad for n, p in params.items()}
    for n, p in params.items():
        p.requires_grad_(n in set(trainable))
    opt = torch.optim.Adam(_param_groups(params, trainable, config.lr))
    step0, history = 0, []
    if state is not None:
        with torch.no_grad():
            for n, t in state["params"].items():
                params[n].copy_(t)
        opt.load_state_dict(state["optimizer"])
        step0, history = int(state["step"]), list(state["history"])

    teacher_cache: dict[int, torch.Tensor] = {}
    cache_ok = sum(s.numel() for s in samples) * model.config.get_text_config().vocab_size * 4 < (512 << 20)
    last_peak: dict[int, float] = dict(state.get("last_peak", {})) if state else {}
    reached_at: int | None = state.get("reached_at") if state else None  # step the target was first met
    penalty = _Penalty(model, watched, config.hinge)
    stop_reason, step = "", step0
    # Dropout stays off (eval mode; gradients flow all the same): the KL compares the student's function with the
    # teacher's, and T5 and BERT checkpoints ship dropout 0.1, which would add noise to both the KL and the peaks.
    model.eval()
    columns = (TextColumn("fine-tune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
    try:
        with Progress(*columns, disable=not progress, transient=False) as bar:
            task = bar.add_task("fine-tune", total=config.steps, completed=step0, info="")
            while step < config.steps:
                i = step % len(samples)
                ids = samples[i].to(next(model.parameters()).device)
                t_logp = teacher_cache.get(i)
                if t_logp is None:
                    t_logp = _teacher_logp(teacher, ids)
                    if cache_ok:
                        teacher_cache[i] = t_logp
                penalty.reset()
                kl = _kl(t_logp, _logits(model, ids))
                pen = penalty.total / ids.numel() if penalty.total is not None else torch.zeros(())
                loss = kl + config.penalty_weight * pen
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                peak = max(penalty.peaks.values(), default=0.0)
                last_peak[i] = peak
                history.append({"step": step, "kl": float(kl.detach()), "penalty": float(pen.detach()), "peak": peak})
                bar.update(task, completed=step, info=f"KL {float(kl.detach()):.2e}  peak {peak:.4g} / target {target:.4g}")
                if len(last_peak) == len(samples) and max(last_peak.values()) <= target:
                    sites = collect(model, samples, progress=False)
                    new = [s for s, st in sites.items() if st.abs_max > threshold and s not in watched]
                    if not new and _max_watched(sites, watched) <= target:
                        reached_at = step if reached_at is None else reached_at
                        if step - reached_at >= config.polish_steps:
                            stop_reason = (f"every watched peak is below {target:.4g} (threshold {threshold:g} with "
                                           f"{config.margin_bits:g} bits margin), first at step {reached_at}")
                            break
                    if new:  # a site pushed over the threshold by the fine-tune itself joins the watched ones
                        watched += new
                        penalty.remove()
                        penalty = _Penalty(model, watched, config.hinge)
                        for n in _trainable(model, new, config.train):
                            if n not in trainable:
                                trainable.append(n)
                                params[n].requires_grad_(True)
                                opt.add_param_group(_param_groups(params, [n], config.lr)[0])
                    last_peak.clear()
                if state_path is not None and (step % config.save_every == 0 or step == config.steps):
                    _save_state(state_path, {
                        "version": STATE_VERSION, "fingerprint": fingerprint, "step": step, "watched": watched,
                        "peaks_before": peaks_before, "trainable": trainable, "history": history,
                        "params": {n: params[n].detach().clone() for n in trainable}, "optimizer": opt.state_dict(),
                        "last_peak": dict(last_peak), "reached_at": reached_at,
                    })
    finally:
        penalty.remove()
        model.eval()
        for n, p in params.items():
            p.requires_grad_(requires[n])

    sites = collect(model, samples, progress=False)
    converged = _max_watched(sites, watched) <= target and all(st.abs_max <= threshold for st in sites.values())
    if not stop_reason:
        stop_reason = ("every watched peak is below the target" if converged
                       else f"reached --steps {config.steps} with peaks still above the target")
    top = max(sites.values(), key=lambda s: s.abs_max)
    with torch.no_grad():
        kls = [float(_kl(_teacher_logp(teacher, s), _logits(model, s))) for s in samples]
    return FinetuneReport(
        steps=step, stop_reason=stop_reason, threshold=threshold, target=target, watched=watched, trainable=trainable,
        peaks_before=peaks_before, peaks_after={s: sites[s].abs_max for s in watched if s in sites},
        max_peak_after=top.abs_max, max_site_after=top.name, kl=sum(kls) / len(kls), converged=converged,
        resumed_from_step=step0 if state is not None else None, history=history,
    )


# -- the pipeline behind `halfsafe finetune` --------------------------------------------------------
def partial_dir(out: str | Path) -> Path:
    """Where an unfinished fine-tune of OUT keeps its state: a hidden folder beside OUT."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def _check_partial(out: str | Path) -> None:
    """OUT's partial folder is absent, or one halfsafe made for OUT (io.owned): halfsafe writes, resumes from and
    deletes no folder of that name it cannot prove it made."""
    folder = partial_dir(out)
    if os.path.lexists(folder) and owned.owned(folder, Path(out), owned.PARTIAL) is None:
        raise HalfsafeError(f"{folder} is where halfsafe keeps an unfinished fine-tune of {Path(out).name}, but halfsafe "
                            f"did not make it: move it aside (or pass --resume-from with a {STATE_NAME} in it), or choose "
                            "another output folder")


def _make_partial(out: str | Path) -> None:
    """OUT's partial folder, made and marked as halfsafe's (io.owned) unless it is already there (`_check_partial`)."""
    folder = partial_dir(out)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir()
    except FileExistsError:
        _check_partial(out)
        return
    owned.release(owned.mark(folder, Path(out), owned.PARTIAL))


def _remove_partial(out: str | Path) -> None:
    folder = partial_dir(out)
    m = owned.owned(folder, Path(out), owned.PARTIAL)
    if m is not None:
        owned.remove(folder, m["folder"])


def finetune_checkpoint(
    source: str,
    out: str,
    texts: list[str] | None = None,
    seq_len: int = FINETUNE_TEXT.seq_len,
    max_samples: int | None = FINETUNE_TEXT.max_samples,
    config: FinetuneConfig | None = None,
    overwrite: bool = False,
    restart: bool = False,
    resume_from: str | None = None,
    save_unconverged: bool = False,
    progress: bool = True,
    device: str = "auto",
    tokenizer: str | None = None,
):
    """Load `source`, rescale exactly, fine-tune what no rescale reaches, save an fp16 checkpoint to `out`.
    Returns (FinetuneReport, ConversionReport, fp16 check dict).

    If `config.steps` run out with peaks still above the target, nothing is saved (unless
    `save_unconverged`): a HalfsafeError says so, and the training state stays in the partial folder,
    so the same command with a larger --steps continues where this one stopped. The options become one checked
    `FinetuneRequest` (halfsafe.requests) before anything runs: `run_finetune`."""
    return run_finetune(FinetuneRequest(source, out, TextOptions(texts, seq_len, max_samples, tokenizer), config or FinetuneConfig(),
                                        overwrite, restart, resume_from, save_unconverged, progress, device))


def run_finetune(request: FinetuneRequest):
    """`halfsafe finetune`, as `finetune_checkpoint`."""
    source, out, config, progress = request.source, request.out, request.config, request.progress
    resume_from, restart = request.resume_from, request.restart
    state_file = Path(resume_from) if resume_from else partial_dir(out) / STATE_NAME

    def check() -> None:
        if resume_from:  # a regular file (a FIFO would hang the read)
            input_file(resume_from, "--resume-from", f"give the state file ({STATE_NAME} in the partial folder)")
        else:
            _check_partial(out)
        if restart and state_file.exists():
            state_file.unlink()

    def work(job: Job) -> Output[tuple[FinetuneReport, ConversionReport, dict]]:
        model, samples = job.loaded.model, job.samples
        if samples:
            require_logits(model, samples[0])  # before the slow part, as for an unsupported architecture
        teacher = copy.deepcopy(model).eval().requires_grad_(False)  # the frozen float32 original
        conversion = rescale_with(model, samples, request.plan, progress)
        if not resume_from:
            _make_partial(out)
        report = finetune_below_threshold(model, samples, config, teacher, progress, state_file)
        del teacher
        if not report.converged and not request.save_unconverged:
            worst = max(report.peaks_after, key=report.peaks_after.get, default=report.max_site_after)
            peak = report.peaks_after.get(worst, report.max_peak_after)
            raise HalfsafeError(
                f"not below the target after {report.steps} steps: {worst} still reaches {peak:.4g} (target {report.target:.4g}); "
                f"the state is kept in {state_file.parent}: run again with a larger --steps to continue, "
                "or pass --save-unconverged to save as it is"
            )
        fp16 = fp16_check(model, samples)
        # its card then says the weights are no longer an exact rescaling
        return Output((report, conversion, fp16), Record(str(source), conversion.saved(), Finetuned(report, fp16)))

    # training holds every weight: never streamed
    options = Options(text=request.text, engine=EngineOptions(stream=False, device=request.device), overwrite=request.overwrite,
                      progress=progress, reads=(("the training state", resume_from),) if resume_from else ())
    done = run(source, out, options, work, check)
    if not resume_from:
        _remove_partial(out)
    return done


@torch.no_grad()
def fp16_check(model: nn.Module, samples: list[torch.Tensor]) -> dict:
    """The fp16 check `scan --fp16-check` runs (`scan.check_fp16`, in the arithmetic convert's trials use), every site
    measured: finite, the largest |x| and its site, and the tokens it ran."""
    return check_fp16(model, samples, resolve(None, model)["used"], stats=True).summary()
