"""The RL overflow models (tests/rl_models.py): shaped as their doc says, finite in fp32, overflowing float16 first at
block 0's down_proj output on any tokens (fp16 autocast over fp32 weights, as an RL loop runs, and a plain .half()
model), and converted by halfsafe into a model whose fp16-autocast forward and loss-scaled backward are finite and
whose fp32 logits are the original's."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rl_models import CHANNEL, first_nonfinite, gemma3_down_proj, gemma4_e2b_like, save
from stress import FP16_MAX

from halfsafe.convert import make_fp16_safe

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)

BUILDS = {"gemma3": gemma3_down_proj, "gemma4_e2b": gemma4_e2b_like}
DOWN = "model.layers.0.mlp.down_proj"
LOSS_SCALE = 2.0**16  # torch's GradScaler starts there
BATCH = (8, 32)  # one GRPO group: 8 completions of 32 tokens
LOGITS_RTOL = 1e-6  # converted vs original fp32 logits, relative to the largest |logit| (measured: 0, bit for bit)


@functools.cache
def _built(key: str):
    return BUILDS[key]()


def _model(key: str):
    return copy.deepcopy(_built(key)[0])


def _ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _outputs(model, ids, names) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """fp32 (input, output) of the modules `names` on `ids`."""
    seen, modules = {}, dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda m, a, o, n=n: seen.update({n: (a[0], o)})) for n in names]
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("key", BUILDS)
def test_shape_size_and_tokenizer(key):
    model, tok = _built(key)
    config = model.config
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() * 4 for p in model.parameters()) < 2**21  # a few MB at most
    assert config.hidden_size == 64 and 2 <= config.num_hidden_layers <= 4 and config.head_dim == 32
    assert len(tok) == config.vocab_size == 256
    assert tok.decode(tok("a b")["input_ids"], skip_special_tokens=True) == "a b"
    assert max(float(p.detach().abs().max()) for p in model.parameters()) < FP16_MAX / 1024  # every weight well under 65504
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    if key == "gemma4_e2b":
        assert type(model).__name__ == "Gemma4ForCausalLM" and config.model_type == "gemma4_text"
        assert config.hidden_size_per_layer_input > 0 and model.model.embed_tokens_per_layer is not None
        modes = config.kv_sharing_modes
        assert config.num_kv_shared_layers > 0 and modes.count("reuse") == config.num_kv_shared_layers
        widths = [layer.mlp.up_proj.out_features for layer in model.model.layers]
        assert config.use_double_wide_mlp
        assert widths == [config.intermediate_size * (2 if m == "reuse" else 1) for m in modes]
    else:
        assert type(model).__name__ == "Gemma3ForCausalLM"


@pytest.mark.parametrize("key", BUILDS)
def test_fp32_finite_with_down_proj_past_float16(key):
    """fp32 is finite everywhere; block 0's gate, up and their product fit float16, down_proj's output passes
    65504 by at least 1 bit on every token."""
    model = _model(key)
    ids = _ids(BATCH, 1)
    assert first_nonfinite(model, ids, autocast=False) is None
    mlp = "model.layers.0.mlp"
    seen = _outputs(model, ids, [f"{mlp}.gate_proj", f"{mlp}.up_proj", DOWN])
    for n in ("gate_proj", "up_proj"):
        assert float(seen[f"{mlp}.{n}"][1].abs().max()) < FP16_MAX / 4
    product, out = seen[DOWN]
    assert float(product.abs().max()) < FP16_MAX
    per_token = out.abs().amax(-1)
    assert float(per_token.min()) > 2 * FP16_MAX, per_token.min()
    assert int(out.abs().amax((0, 1)).argmax()) == CHANNEL


@pytest.mark.parametrize("key", BUILDS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_float16_overflows_first_at_block0_down_proj_on_any_tokens(key, data):
    """Any tokens (RL feeds sampled completions): block 0's down_proj puts out more than 2 x 65504 in fp32 on every
    position; under fp16 autocast over the fp32 weights and in a .half() model it is the first non-finite module
    output (its input, the gated product, still finite), on every position."""
    model = _built(key)[0]
    ids = torch.tensor([data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=32), label="ids")])
    fp32 = _outputs(model, ids, [DOWN])[DOWN][1]
    assert float(fp32.abs().amax(-1).min()) > 2 * FP16_MAX
    assert first_nonfinite(model, ids, autocast=True) == DOWN
    assert first_nonfinite(_half(key), ids, autocast=False) == DOWN
    with torch.autocast("cpu", dtype=torch.float16):
        out = _outputs(model, ids, [DOWN])[DOWN][1]
    assert not torch.isfinite(out).all(-1).any()  # every token overflows


@functools.cache
def _half(key: str):
    return _model(key).half()


def test_first_nonfinite_names_the_module_or_its_input():
    model = _model("gemma3")
    ids = _ids((1, 16), 2)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight[:, CHANNEL] *= 4  # the gated product passes 65504 first, between modules
    assert first_nonfinite(model, ids) == f"{DOWN}:input"
    with torch.no_grad():
        mlp.gate_proj.weight[:, CHANNEL] *= 2**10  # now gate_proj itself
    assert first_nonfinite(model, ids) == "model.layers.0.mlp.gate_proj"
    model = _model("gemma3")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[CHANNEL] /= 16
    assert first_nonfinite(model, ids) is None


def _autocast_step(model, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An RL loop's first step: fp16 autocast forward, causal-LM loss x GradScaler's initial scale, backward."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    (out.loss * LOSS_SCALE).backward()
    return out.logits, [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("key", BUILDS)
def test_converted_trains_in_fp16_where_the_original_cannot(key):
    model = _model(key)
    converted = _model(key)
    report = make_fp16_safe(converted, samples=[_ids((1, 32), 0)], progress=False)
    assert report.plan.exponents["residual"] < 0  # the residual group moves down_proj with the stream
    for seed in (11, 12, 13):
        ids = _ids(BATCH, seed)
        logits, _ = _autocast_step(model, ids)
        assert not torch.isfinite(logits).all()  # the original: non-finite at the first step
        logits, grads = _autocast_step(converted, ids)
        assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads)
        with torch.no_grad():
            assert torch.isfinite(copy.deepcopy(converted).half()(input_ids=ids).logits).all()
            want, got = model(input_ids=ids).logits, converted(input_ids=ids).logits
        assert float((got - want).abs().max()) <= LOGITS_RTOL * float(want.abs().max())


@pytest.mark.parametrize("key", BUILDS)
def test_save_loads_offline_with_its_tokenizer(key, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = _built(key)
    save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32" and config["vocab_size"] == 256
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _ids((1, 16), 3)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path).get_vocab() == tok.get_vocab()
