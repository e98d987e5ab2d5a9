"""Write a random checkpoint whose residual stream overflows float16, for measuring halfsafe on models bigger than
the test suite can hold: Llama-style sizes, and the exact DeepSeek-R1-Distill-Qwen-7B architecture.

    python bench/tools/make_synthetic.py OUT [--size 1.2b|0.3b|0.6b|2.4b|qwen7b|qwen7b-tiny|...] [--shard-size 1GB]

Weights are random (seeded) and stored in bfloat16, one tensor generated at a time (memory: one shard). The
residual stream is blown past 65504 by an *exact* rescale, as bf16 training leaves real models: a base model whose
activations fit is multiplied by 2^13 along its residual stream (embedding, o_proj and down_proj with their biases;
the norm eps by 2^26, so every RMSNorm computes the same), and every block adds to one channel, the "massive
activation" real models grow. Every stored weight stays below 65504.

Llama sizes: every block's down_proj bias adds to channel 0. Qwen2 has no o_proj or down_proj bias, so there the
constant comes through attention: value dim 0 of KV head 0 is its bias alone (weight row zero), and softmax weights
sum to 1, so every query head reading that KV head outputs that constant in its dim 0; o_proj's row 0 takes it
from those heads, so each block adds 14 / layers to channel 0 (2 -> 16, times 2^13 = 131072, at any depth).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

WRITES = ()  # prints only: nothing in bench/results/ (python bench/list.py)

SIZES = {  # name -> (hidden, layers, intermediate); vocab 32000, untied head, 16 heads
    "0.3b": (1024, 16, 2816),
    "0.6b": (1536, 16, 4096),
    "1.2b": (2048, 20, 5632),
    "2.4b": (2560, 26, 6912),
}
# DeepSeek-R1-Distill-Qwen-7B (its config.json, as its fine-tunes copy it, e.g.
# huggingface.co/unsloth/DeepSeek-R1-Distill-Qwen-7B-unsloth-bnb-4bit/blob/main/config.json; the fields as
# transformers' configuration_qwen2.py names them): name -> (hidden, layers, intermediate, heads, KV heads).
# The tiny one keeps its rules for tests of this script: 7 query heads per KV head, intermediate 37/7 x hidden,
# the 152064 vocabulary (its embedding and head are wide tensors, as at 7B), everything else the same.
QWEN_SIZES = {
    "qwen7b": (3584, 28, 18944, 28, 4),
    "qwen7b-tiny": (448, 4, 2368, 7, 1),
}
RESIDUAL_SCALE = 13  # the residual stream is 2^13 times the base model's
MASSIVE = 0.25  # each block's down_proj bias adds this (times 2^13) to channel 0
QWEN_MASSIVE_GROWTH = 14.0  # Qwen: channel 0 grows by this (times 2^13) over all blocks, whatever their number


def config_for(size: str, scale_bits: int = RESIDUAL_SCALE) -> PretrainedConfig:
    if size in QWEN_SIZES:
        return qwen_config(size, scale_bits)
    hidden, layers, inter = SIZES[size]
    return LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=False,
                       mlp_bias=True, rms_norm_eps=1e-5 * 4.0 ** scale_bits, dtype="bfloat16",
                       architectures=["LlamaForCausalLM"])


def qwen_config(size: str, scale_bits: int = RESIDUAL_SCALE) -> Qwen2Config:
    hidden, layers, inter, heads, kv_heads = QWEN_SIZES[size]
    return Qwen2Config(vocab_size=152064, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_act="silu",
                       max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       use_sliding_window=False, sliding_window=None, max_window_layers=layers,
                       tie_word_embeddings=False, rms_norm_eps=1e-6 * 4.0 ** scale_bits, bos_token_id=151646,
                       eos_token_id=151643, dtype="bfloat16", architectures=["Qwen2ForCausalLM"])


def value(name: str, shape: tuple, gen: torch.Generator, scale_bits: int = RESIDUAL_SCALE) -> torch.Tensor:
    s = 2.0 ** scale_bits
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


def qwen_value(name: str, shape: tuple, gen: torch.Generator, config: Qwen2Config,
               scale_bits: int = RESIDUAL_SCALE) -> torch.Tensor:
    """One Qwen2 tensor: the base model's, times 2^scale_bits where it writes the residual stream."""
    on_residual = "down_proj" in name or "o_proj" in name or "embed_tokens" in name
    s = 2.0 ** scale_bits if on_residual else 1.0
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):  # q, k and v only
        t = 0.01 * torch.randn(shape, generator=gen)
        if "v_proj" in name:
            t[0] = 1.0  # value dim 0 of KV head 0: this constant (its weight row is zeroed below)
        return t
    if "embed_tokens" in name:
        t = torch.randn(shape, generator=gen)
        t[:, 0] = 2.0  # the massive channel starts here
        return t.mul_(s)
    t = torch.randn(shape, generator=gen).div_(math.sqrt(shape[-1]))
    if "v_proj" in name:
        t[0] = 0.0
    if "o_proj" in name:  # query heads 0 .. group-1 read KV head 0 (repeat_kv); row 0 takes their dim 0
        head_dim = config.hidden_size // config.num_attention_heads
        group = config.num_attention_heads // config.num_key_value_heads
        t[0, [h * head_dim for h in range(group)]] = QWEN_MASSIVE_GROWTH / (config.num_hidden_layers * group)
    return t.mul_(s)


def shards(size: str, shard_size: str, seed: int = 0, scale_bits: int = RESIDUAL_SCALE):
    """The checkpoint's config and its split, then (file name, tensors) one shard at a time, in bfloat16."""
    config = config_for(size, scale_bits)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    layout = {n: torch.empty(p.shape, dtype=torch.bfloat16, device="meta") for n, p in skeleton.state_dict().items()}
    split = split_torch_state_dict_into_shards(layout, filename_pattern="model{suffix}.safetensors", max_shard_size=shard_size)
    gen = torch.Generator().manual_seed(seed)

    def make(n: str) -> torch.Tensor:
        shape = tuple(layout[n].shape)
        t = qwen_value(n, shape, gen, config, scale_bits) if size in QWEN_SIZES else value(n, shape, gen, scale_bits)
        return t.to(torch.bfloat16).contiguous()

    return config, split, ((filename, {n: make(n) for n in names}) for filename, names in split.filename_to_tensors.items())


def write_checkpoint(out: Path, size: str, shard_size: str, seed: int = 0, scale_bits: int = RESIDUAL_SCALE) -> int:
    """Write the checkpoint into the new folder OUT, one shard in memory at a time; returns its parameter count."""
    out.mkdir(parents=True, exist_ok=False)
    config, split, files = shards(size, shard_size, seed, scale_bits)
    n_params = 0
    for filename, tensors in files:
        n_params += sum(t.numel() for t in tensors.values())
        save_file(tensors, out / filename, metadata={"format": "pt"})
        print(f"wrote {filename} ({len(tensors)} tensors)", flush=True)
        del tensors
    if split.is_sharded:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2))
    config.save_pretrained(out)
    return n_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size", default="1.2b", choices=sorted(SIZES) + sorted(QWEN_SIZES))
    ap.add_argument("--shard-size", default=None,
                    help="largest weight file (default 5GB, the hub's, for the qwen sizes; 1GB for the llama ones, "
                         "as bench/cost/engine_scale.py measured them)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    shard_size = args.shard_size or ("5GB" if args.size in QWEN_SIZES else "1GB")
    n_params = write_checkpoint(out, args.size, shard_size, args.seed)
    print(f"{out}: {n_params / 1e9:.2f}B parameters, {2 * n_params / 1e9:.1f} GB in bfloat16, "
          f"{4 * n_params / 1e9:.1f} GB in float32")


if __name__ == "__main__":
    main()
