"""T5 beyond the generic family tests: the `_keep_in_fp32_modules` trap when loading float16, Flan-T5's
gelu*linear product overflowing before `wo`, and layouts the tiny configs do not build (a v1.1 checkpoint's
own lm_head, the encoder-only class, uneven encoder/decoder depth)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import TINY, make_tiny, random_exponents, tiny_ids
from torch import nn
from transformers import AutoModelForSeq2SeqLM, T5EncoderModel, T5ForConditionalGeneration

from halfsafe.convert import make_fp16_safe
from halfsafe.core.formats import FP16_MAX
from halfsafe.core.forward import logits
from halfsafe.core.groups import expand
from halfsafe.core.metrics import mean_kl
from halfsafe.core.rewrite import apply_exponents_
from halfsafe.core.stats import first_tensor
from halfsafe.engine.precision import cast_copy
from halfsafe.families import family_for
from halfsafe.families.spec import tied_head
from halfsafe.runtime.fp16 import load_pure_fp16
from halfsafe.scan import scan

KEY = "t5-v1_1"
FAMILY = family_for("t5")


def _v1_1_checkpoint_layout(tmp_path) -> T5ForConditionalGeneration:
    """A tiny T5 v1.1 as transformers 5 loads a real one: T5Config forces tie_word_embeddings=True, and
    from_pretrained unties only the head, because the checkpoint holds an lm_head unlike `shared`."""
    model = make_tiny(KEY)
    model.lm_head.weight = nn.Parameter(torch.randn_like(model.shared.weight).bfloat16().float())
    model.save_pretrained(tmp_path / "v1_1")
    loaded = T5ForConditionalGeneration.from_pretrained(tmp_path / "v1_1", dtype=torch.float32).eval()
    assert not tied_head(loaded) and loaded.encoder.embed_tokens.weight is loaded.shared.weight
    return loaded


def _residual_peak(model, ids) -> float:
    return max(layer.residual_peak for layer in scan(model, [ids], progress=False).layers)


def _product_peak(model, ids) -> float:
    """The largest input of any `wo`: the gelu*linear product of a gated feed-forward."""
    return max(s.abs_max for n, s in scan(model, [ids], progress=False).sites.items() if n.endswith(".wo:in"))


def _residual_dtype(model, ids) -> torch.dtype:
    """The dtype of the residual stream leaving the last decoder block."""
    seen = []
    handle = model.decoder.block[-1].register_forward_hook(lambda mod, args, out: seen.append(first_tensor(out).dtype))
    try:
        logits(model, ids)
    finally:
        handle.remove()
    return seen[0]


def _all_fp16(model) -> bool:
    return all(p.dtype == torch.float16 for p in model.parameters())


def test_converted_checkpoint_is_all_fp16_only_through_load_pure_fp16(tmp_path):
    model = _v1_1_checkpoint_layout(tmp_path)
    ids = tiny_ids(model, length=16)
    k = math.ceil(math.log2(4 * FP16_MAX / _residual_peak(model, ids)))
    apply_exponents_(model, FAMILY, expand(FAMILY, model), {"residual": k})
    assert _residual_peak(model, ids) > 4 * FP16_MAX
    ref = logits(model, ids)
    cast_copy(model, torch.float16).save_pretrained(tmp_path / "stress")
    make_fp16_safe(model, samples=[ids], progress=False)
    cast_copy(model, torch.float16).save_pretrained(tmp_path / "safe")

    # (a) A plain float16 load keeps every wo in float32, and wo's output makes the residual float32.
    plain = T5ForConditionalGeneration.from_pretrained(tmp_path / "safe", dtype=torch.float16)
    kept = {n for n, p in plain.named_parameters() if p.dtype == torch.float32}
    assert kept and all(n.endswith("DenseReluDense.wo.weight") for n in kept)
    assert len(kept) == plain.config.num_layers + plain.config.num_decoder_layers
    assert _residual_dtype(plain, ids) == torch.float32

    # (b) The helper gives a genuinely float16 model, from a model class or an Auto class alike.
    for cls in (T5ForConditionalGeneration, AutoModelForSeq2SeqLM):
        pure = load_pure_fp16(cls, tmp_path / "safe")
        assert _all_fp16(pure) and _residual_dtype(pure, ids) == torch.float16
        out = logits(pure, ids).float()
        assert torch.isfinite(out).all()
        assert mean_kl(ref, out) < 1e-4

    # (c) Unconverted, the same weights overflow float16.
    stress = load_pure_fp16(T5ForConditionalGeneration, tmp_path / "stress")
    assert _all_fp16(stress)
    assert not torch.isfinite(logits(stress, ids)).all()


def test_flan_gelu_times_linear_overflow_is_fixed_by_the_wi1_wo_pair():
    model = make_tiny(KEY)
    ids = tiny_ids(model, length=16)
    ref = logits(model, ids)
    groups = expand(FAMILY, model)
    pairs = [g.name for g in groups if g.spec in ("enc_wi1_wo", "dec_wi1_wo")]
    k = math.ceil(math.log2(2 * FP16_MAX / _product_peak(model, ids)))
    apply_exponents_(model, FAMILY, groups, dict.fromkeys(pairs, k))  # wi_1 x 2**k, wo / 2**k: exact
    assert _product_peak(model, ids) > FP16_MAX > 4 * _residual_peak(model, ids)
    assert not torch.isfinite(logits(cast_copy(model, torch.float16), ids)).all()

    report = make_fp16_safe(model, samples=[ids], progress=False)
    assert not report.unfixable
    assert all(report.plan.exponents.get(g, 0) < 0 for g in pairs)
    out = logits(cast_copy(model, torch.float16), ids).float()
    assert torch.isfinite(out).all()
    assert mean_kl(ref, out) < 1e-4


def _encoder_only():
    return T5EncoderModel(TINY[KEY]())


def _uneven_depth():  # t5-efficient style: fewer decoder than encoder layers
    config = TINY[KEY]()
    config.num_decoder_layers = 1
    return T5ForConditionalGeneration(config)


@pytest.mark.parametrize("build", [_encoder_only, _uneven_depth])
def test_other_layouts_expand_fully_and_stay_exact(build):
    model = build().eval()
    model.load_state_dict(make_tiny(KEY).state_dict(), strict=False)  # the tiny model's randomised weights
    ids = tiny_ids(model)
    ref = logits(model, ids)
    groups = expand(FAMILY, model)
    moved = {m.param for g in groups for m in g.moves}
    paired = (".q.weight", ".k.weight", ".v.weight", ".o.weight", ".wi_1.weight", ".wo.weight")
    assert {n for n, _ in model.named_parameters() if n.endswith(paired)} <= moved  # every block of every stack
    apply_exponents_(model, FAMILY, groups, random_exponents(groups, 0))
    out = logits(model, ids)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-6


def _blown_up_three_blocks(key: str):
    """3 encoder and 3 decoder blocks, the residual stream grown past 65504 by an exact rescale (as bf16 training
    grows T5's): the stack's dropout then sees the grown embeddings at its first call and the final norm's
    output, which does not grow, at its second."""
    config = TINY[key]()
    config.num_layers = config.num_decoder_layers = 3
    torch.manual_seed(0)
    model = type(make_tiny(key))(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p + torch.randn_like(p) * 0.1 * (p.dim() == 1)).bfloat16().float())
    ids = tiny_ids(model, length=16)
    k = math.ceil(math.log2(4 * FP16_MAX / _residual_peak(model, ids)))
    apply_exponents_(model, FAMILY, expand(FAMILY, model), {"residual": k})
    return model


@pytest.mark.parametrize("key", ["t5", "t5-v1_1"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_stack_dropout_is_two_sites_and_the_shrunk_probe_moves_each_as_its_call_does(key, seed):
    from halfsafe.core.shrink import probe_governed

    model = _blown_up_three_blocks(key)
    ids = tiny_ids(model, length=16, seed=seed)
    sites = scan(model, [ids], progress=False).sites
    assert sites["decoder.dropout:in"].abs_max == sites["decoder.embed_tokens:out"].abs_max > FP16_MAX
    assert sites["decoder.dropout:in@2"].abs_max == sites["decoder.final_layer_norm:out"].abs_max < FP16_MAX
    residual = probe_governed(model, FAMILY, expand(FAMILY, model), ids)["residual"]
    for stack in ("encoder", "decoder"):
        assert residual[f"{stack}.dropout:out"] == residual[f"{stack}.embed_tokens:out"] == 1
        assert residual.get(f"{stack}.dropout:out@2") == residual.get(f"{stack}.final_layer_norm:out")
    assert residual["decoder.block.2.layer.2:out"] == 1
    report = make_fp16_safe(model, samples=[ids], progress=False)
    assert not report.unfixable
    assert torch.isfinite(logits(cast_copy(model, torch.float16), ids)).all()
