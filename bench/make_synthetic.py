"""Write a random Llama-style checkpoint whose residual stream overflows float16, for measuring halfsafe on models
bigger than the test suite can hold.

    python bench/make_synthetic.py OUT [--size 1.2b|0.3b|0.6b|2.4b|...] [--shard-size 1GB]

Weights are random (seeded) and stored in bfloat16, one tensor generated at a time (memory: one shard). The
residual stream is blown past 65504 by an *exact* rescale, as bf16 training leaves real models: a base model whose
activations fit is multiplied by 2^13 along its residual stream (embedding, o_proj and down_proj with their biases;
the norm eps by 2^26, so every RMSNorm computes the same), and every block's down_proj bias adds to one channel, the
"massive activation" real models grow. Every stored weight stays far below 65504.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

SIZES = {  # name -> (hidden, layers, intermediate); vocab 32000, untied head, 16 heads
    "0.3b": (1024, 16, 2816),
    "0.6b": (1536, 16, 4096),
    "1.2b": (2048, 20, 5632),
    "2.4b": (2560, 26, 6912),
}
RESIDUAL_SCALE = 13  # the residual stream is 2^13 times the base model's
MASSIVE = 0.25  # each block's down_proj bias adds this (times 2^13) to channel 0


def config_for(size: str) -> LlamaConfig:
    hidden, layers, inter = SIZES[size]
    return LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=False,
                       mlp_bias=True, rms_norm_eps=1e-5 * 4.0 ** RESIDUAL_SCALE, dtype="bfloat16",
                       architectures=["LlamaForCausalLM"])


def value(name: str, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    s = 2.0 ** RESIDUAL_SCALE
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        t = 0.01 * torch.randn(shape, generator=gen)
        if "down_proj" in name:
            t[0] = MASSIVE
        return t * (s if ("down_proj" in name or "o_proj" in name) else 1.0)
    if "embed_tokens" in name:
        t = torch.randn(shape, generator=gen)
        t[:, 0] = 2.0  # the massive channel starts here
        return t * s
    fan_in = shape[-1]
    t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    return t * (s if ("down_proj" in name or "o_proj" in name) else 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size", default="1.2b", choices=sorted(SIZES))
    ap.add_argument("--shard-size", default="1GB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    config = config_for(args.size)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    shapes = {n: p for n, p in skeleton.state_dict().items()}
    layout = {n: torch.empty(p.shape, dtype=torch.bfloat16, device="meta") for n, p in shapes.items()}
    split = split_torch_state_dict_into_shards(layout, filename_pattern="model{suffix}.safetensors", max_shard_size=args.shard_size)
    gen = torch.Generator().manual_seed(args.seed)
    n_params = 0
    for filename, names in split.filename_to_tensors.items():
        tensors = {n: value(n, tuple(layout[n].shape), gen).to(torch.bfloat16).contiguous() for n in names}
        n_params += sum(t.numel() for t in tensors.values())
        save_file(tensors, out / filename, metadata={"format": "pt"})
        print(f"wrote {filename} ({len(names)} tensors)")
    if split.is_sharded:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2))
    config.save_pretrained(out)
    print(f"{out}: {n_params / 1e9:.2f}B parameters, {4 * n_params / 1e9:.1f} GB in float32")


if __name__ == "__main__":
    main()
