"""GRPO runs of tests/test_rl.py: TRL's GRPOTrainer with vLLM rollouts (colocated) wrapped by halfsafe.training.rl,
run by the vLLM environment's python (tests/vllmenv.py, which has TRL too). One job per process, as JSON in argv[1];
the JSON result on the last line of stdout.

job: {"model": folder, "out": folder (TRL's output_dir, and the trainer's files), "steps", "precision": "fp16"|"bf16",
      "rescale_below_bits"?, "rescale_to_bits"?, "init_scale"?, "lr"?, "seed"?, "completion"? (tokens),
      "save"?: folder (Fp16RL.save after training), "save_by_hand"?: folder (the trainer's own save_model, the model folder's halfsafe.json copied in),
      "params"?: file (the trained parameters, float32 safetensors)}
result: {"steps": Fp16RL.steps, "rescales", "vllm_weights_max_diff" (vLLM's weights against the trainer's, after one
         more push), "eps": {"trainer": [every norm's eps], "vllm": [...]}, "saved"/"save_error", "logged": the mismatch
         keys the Trainer's log history holds}

The engine is built as TRL builds it, with `enforce_eager=True` and a 32 MiB KV cache added (vLLM's graph compilation
would take most of a tiny case's time; it computes the same operations).
"""

from __future__ import annotations

import json
import os
import sys

# a vLLM process of these runs (and of bench/training/rl_fp16*.py): offline, the engine in this process (TRL's colocate mode),
# threads left unpinned
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
os.environ.update(VLLM_ENV)


def eager_engine(kv_cache_bytes: int = 32 << 20) -> None:
    """TRL's colocated engine built as TRL builds it, plus `enforce_eager=True` and a fixed KV cache size."""
    import functools

    import trl.generation.vllm_generation as generation

    generation.LLM = functools.partial(generation.LLM, enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes)


def grpo_args(out: str, precision: str, steps: int, **more):
    """The GRPOConfig of these runs and the bench's: `precision`'s autocast ("fp16" with loss scaling, or "bf16"), TRL's
    colocated vLLM, 2 prompts x 4 samples per step, the policy loaded in float32 (the trainer's master weights), one
    log per step; `more` sets the rest (learning_rate, seed, max_completion_length, vllm_max_model_length, ...)."""
    from trl import GRPOConfig

    fp16 = precision == "fp16"
    more.setdefault("use_cpu", True)
    return GRPOConfig(output_dir=out, fp16=fp16, bf16=not fp16, use_vllm=True, vllm_mode="colocate",
                      per_device_train_batch_size=8, num_generations=4, max_steps=steps, logging_steps=1, report_to=[],
                      save_strategy="no", model_init_kwargs={"dtype": "float32"}, disable_tqdm=True, **more)


def _norm_eps(model) -> list[float]:
    out = []
    for m in model.modules():
        for attr in ("variance_epsilon", "eps"):
            v = getattr(m, attr, None)
            if isinstance(v, float) and "Norm" in type(m).__name__:
                out.append(v)
    return sorted(set(out))


def grpo(job: dict) -> dict:
    import math

    from datasets import Dataset
    from trl import GRPOTrainer

    from halfsafe.errors import HalfsafeError
    from halfsafe.training import rl

    rl.prepare_vllm()
    eager_engine()
    prompts = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(10)]

    def reward(completions, **kw):  # any signal will do: the tests watch the arithmetic, not the learning
        return [float(len(c) % 3) for c in completions]

    args = grpo_args(job["out"], job.get("precision", "fp16"), job["steps"], vllm_max_model_length=128,
                     max_completion_length=job.get("completion", 16), learning_rate=job.get("lr", 1e-3),
                     seed=job.get("seed", 0), optim=job.get("optim", "adamw_torch"))
    trainer = GRPOTrainer(model=job["model"], args=args, reward_funcs=reward, train_dataset=Dataset.from_list(prompts))
    loop = rl.Fp16RL(trainer, rescale_below_bits=job.get("rescale_below_bits", 1.0),
                     rescale_to_bits=job.get("rescale_to_bits", 3.0), init_scale=job.get("init_scale", 2.0 ** 16))
    rollouts = []  # a digest of each step's sampled completions: two runs saw the same rollouts or not
    score = trainer._generate_and_score_completions

    def recorded(*a, **kw):
        got = score(*a, **kw)
        rollouts.append(hash(tuple(map(tuple, got["completion_ids"].tolist()))))
        return got
    trainer._generate_and_score_completions = recorded
    trainer.train()
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h}
    for s in loop.steps:
        s["loss"] = losses.get(s["step"], math.nan)
    out = {"steps": loop.steps, "rescales": loop.headroom.rescales, "arith": loop.arith, "rollouts": rollouts,
           "rollout_dtype": loop.rollout_dtype}
    out["logged"] = sorted({k for h in trainer.state.log_history for k in h if k.startswith(("mismatch/", "peaks/", "headroom/"))})
    trainer.vllm_generation.sync_weights()  # the last step's weights (and eps), as the next rollout would get them
    vm = rl.vllm_model(trainer)
    # vLLM fuses q/k/v and gate/up: compare through its own loader's view, tensor by tensor where names match
    theirs = dict(vm.named_parameters())
    diffs = []
    for name, p in trainer.model.named_parameters():
        v = theirs.get(name)
        if v is not None and v.shape == p.shape:
            diffs.append(float((v.detach().float() - p.detach().to(v.dtype).float()).abs().max()))
    out["vllm_weights_compared"] = len(diffs)
    out["vllm_weights_max_diff"] = max(diffs) if diffs else math.nan
    out["eps"] = {"trainer": _norm_eps(trainer.model), "vllm": _norm_eps(vm)}
    if job.get("params"):
        from safetensors.torch import save_file

        save_file({k: v.detach().float().clone() for k, v in trainer.model.named_parameters()}, job["params"])
    if job.get("save"):
        try:
            out["saved"] = str(loop.save(job["save"]))
        except HalfsafeError as e:
            out["save_error"] = str(e)
    if job.get("save_by_hand"):
        import shutil

        trainer.save_model(job["save_by_hand"])  # the trainer's own save, and the folder's old record copied beside it
        shutil.copy2(os.path.join(job["model"], "halfsafe.json"), job["save_by_hand"])
    return out


if __name__ == "__main__":
    result = grpo(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print(json.dumps(result, allow_nan=True))
