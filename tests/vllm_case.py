"""vLLM processes of tests/test_vllm.py, run by the vLLM environment's python (tests/vllmenv.py): a JSON list of
jobs in argv[1], run in order in this one process (vLLM's import and start-up are most of a case's time), a JSON
list of results on the last line of stdout, one per job (a job that raises gives {"error": ...}). Standard library
and vLLM only: halfsafe's plugin comes in through its entry point, as in any vLLM process.

jobs:
  {"op": "config", "model", "dtype", "hf_overrides"?, "hf_config_path"?}: the dtype vLLM's ModelConfig resolves (or its
      error): where the float16 check is; the config built as `--hf-overrides` / `--hf-config-path` build it
  {"op": "dtype", "model", "dtype", "set"?: {dotted field: value}}: the same from vLLM's dtype check alone, on the
      folder's HF config (with `set`'s fields changed on it, a sub-config's too)
  {"op": "run", "model", "dtype", "prompts": [[ids]], "new_tokens", "lift": bool}: LLM.generate's greedy tokens and
      their logprobs, the dtype vLLM ran in and its weights' dtypes; `lift` empties vLLM's float16 table by hand for
      this job (to run the unconverted model in float16 and show what float16 does to it)
"""

from __future__ import annotations

import gc
import json
import math
import sys


def config(job):
    from vllm.engine.arg_utils import EngineArgs

    extra = {k: job[k] for k in ("hf_overrides", "hf_config_path") if k in job}
    got = EngineArgs(model=job["model"], dtype=job["dtype"], max_model_len=128, **extra).create_model_config()
    return {"dtype": str(got.dtype).removeprefix("torch.")}


def dtype(job):
    """vLLM's dtype check itself on a folder's HF config, without the model's other start-up checks (Gemma 3
    multimodal: vLLM inspects its processor first, which needs a CPU torchvision this environment cannot have)."""
    from transformers import AutoConfig
    from vllm.config import model as config_model

    hf = AutoConfig.from_pretrained(job["model"])
    for dotted, value in job.get("set", {}).items():
        *parents, name = dotted.split(".")
        target = hf
        for p in parents:
            target = getattr(target, p)
        setattr(target, name, value)
    got = config_model._get_and_verify_dtype(job["model"], hf, job["dtype"], is_pooling_model=False, revision=None)
    return {"dtype": str(got).removeprefix("torch.")}


def run(job):
    from vllm import LLM, SamplingParams
    from vllm.config import model as config_model

    table = config_model._FLOAT16_NOT_SUPPORTED_MODELS
    saved = dict(table)
    if job.get("lift"):
        table.clear()
    try:
        llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=128, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=32 << 20, skip_tokenizer_init=True, limit_mm_per_prompt=job.get("limit_mm"))
    finally:
        table.update(saved)
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], logprobs=0, detokenize=False, ignore_eos=True)
    done = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    result = {"dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."), "weight_dtypes": _weight_dtypes(llm),
              "outputs": []}
    for d in done:
        c = d.outputs[0]
        lps = [lp[t].logprob if lp and t in lp else math.nan for t, lp in zip(c.token_ids, c.logprobs)]
        result["outputs"].append({"tokens": list(c.token_ids), "logprobs": [x if math.isfinite(x) else str(x) for x in lps]})
    del llm, done
    gc.collect()
    return result


def _weight_dtypes(llm):
    """The dtypes of the model's parameters as vLLM holds them (the engine in this process)."""
    try:
        model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
        return sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    except AttributeError as e:
        return [f"unknown ({e})"]


def main(jobs):
    out = []
    for job in jobs:
        try:
            out.append({"config": config, "dtype": dtype, "run": run}[job["op"]](job))
        except Exception as e:  # noqa: BLE001 (a refusal is an answer)
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
