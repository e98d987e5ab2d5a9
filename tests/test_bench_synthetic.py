"""bench/tools/make_synthetic.py's Qwen2 checkpoints: the 7B config is DeepSeek-R1-Distill-Qwen-7B's, and the tiny one of the
same architecture is an exact 2^13 rescale of its base model whose residual stream overflows float16 (in fp32 and
bf16 runs) and loads with transformers."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

FP16_MAX = 65504.0


def test_qwen7b_is_the_published_architecture(bench_script):
    ms = bench_script("tools", "make_synthetic")
    c = ms.config_for("qwen7b")
    assert (c.model_type, c.architectures, c.hidden_size, c.num_hidden_layers, c.intermediate_size,
            c.num_attention_heads, c.num_key_value_heads, c.vocab_size, c.max_position_embeddings,
            c.tie_word_embeddings, c.use_sliding_window, c.rope_parameters["rope_theta"]) == (
        "qwen2", ["Qwen2ForCausalLM"], 3584, 28, 18944, 28, 4, 152064, 131072, False, False, 10000.0)
    assert c.rms_norm_eps == 1e-6 * 2.0 ** 26  # the published 1e-6, times the residual scale squared
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    assert sum(p.numel() for p in model.parameters()) == 7_615_616_512  # 7.62B, 15.2 GB in bf16


def test_tiny_qwen_is_an_exact_rescale_that_overflows_fp16(tmp_path, bench_script):
    ms = bench_script("tools", "make_synthetic")
    assert ms.write_checkpoint(tmp_path / "syn", "qwen7b-tiny", "5GB") > 0
    scaled = AutoModelForCausalLM.from_pretrained(tmp_path / "syn", dtype=torch.float32).eval()
    assert type(scaled).__name__ == "Qwen2ForCausalLM"

    base_config, _, files = ms.shards("qwen7b-tiny", "5GB", scale_bits=0)  # same seed, no rescale
    base = copy.deepcopy(scaled)  # (faster than a fresh model's random init)
    base.config.rms_norm_eps = base_config.rms_norm_eps
    for layer_norm in [m for m in base.modules() if hasattr(m, "variance_epsilon")]:
        layer_norm.variance_epsilon = base_config.rms_norm_eps
    base.load_state_dict({n: t for _, shard in files for n, t in shard.items()})
    s = 2.0 ** ms.RESIDUAL_SCALE
    for name, w in scaled.state_dict().items():  # the rescale is the only difference, bit for bit
        writes_residual = any(k in name for k in ("embed_tokens", "o_proj", "down_proj"))
        assert torch.equal(w, base.state_dict()[name] * (s if writes_residual else 1.0)), name

    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, ref = scaled(ids, output_hidden_states=True), base(ids, output_hidden_states=True)
        for h, r in zip(out.hidden_states[:-1], ref.hidden_states[:-1]):  # [-1] is after the final norm
            assert torch.equal(h, r * s)
        assert torch.equal(out.logits, ref.logits)  # the same function
        assert max(h.abs().max() for h in out.hidden_states[:-1]) > FP16_MAX  # fp32 run
        bf16 = scaled.to(torch.bfloat16)(ids, output_hidden_states=True)
        assert max(h.float().abs().max() for h in bf16.hidden_states[:-1]) > FP16_MAX
        assert torch.isfinite(bf16.logits).all()
        assert not torch.isfinite(scaled.to(torch.float16)(ids[:, :2]).logits).all()
