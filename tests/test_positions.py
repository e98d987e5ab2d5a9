"""Samples no longer than a model's learned absolute positions (calibration.fit_positions): a model whose position
table ends before --seq-len (the tiny gpt2, gpt_neo, bart, bert, roberta and pegasus have 128 positions, the default
is 512) is calibrated and scanned on samples as long as its table, with a note on stderr; a --long-sample longer
than the table is refused in one line naming the longest that fits, nothing written. Before this, an IndexError deep
in the embedding."""

from __future__ import annotations

import pytest
import torch
from hostile import refused
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import TINY, make_tiny

from halfsafe.calibration import fit_positions, position_limit
from halfsafe.cli import main
from halfsafe.io.loading import model_class_for

pytestmark = pytest.mark.usefixtures("one_thread")

LEARNED = {"gpt2": "gpt2", "gpt_neo": "gpt_neo", "bart": "bart", "bert": "bert", "roberta": "roberta", "pegasus": "pegasus"}


def test_every_tiny_family_with_learned_positions_is_found():
    """position_limit finds a table exactly in the model types listed here (so the property below covers each)."""
    found = {TINY[k]().model_type for k in TINY if position_limit(make_tiny(k)) is not None}
    assert found == set(LEARNED.values())


def _runs(model, n: int) -> bool:
    ids = torch.full((1, n), 5)
    try:
        with torch.no_grad():
            model(input_ids=ids, **({"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}))
    except (IndexError, RuntimeError):
        return False
    return True


@settings(max_examples=30, deadline=None)
@given(key=st.sampled_from(sorted(LEARNED)), positions=st.integers(8, 40), seq_len=st.integers(2, 80))
def test_samples_fit_the_positions_any_length(key, positions, seq_len):
    """Any table length and any seq_len: the model runs on position_limit tokens and not one more; a default seq_len is
    shortened to that limit (and said), one asked for that is longer refused naming it, one that fits kept."""
    torch.manual_seed(0)
    config = TINY[key]()
    config.max_position_embeddings = positions
    model = model_class_for(config)(config).eval()
    limit = position_limit(model)
    assert _runs(model, limit) and not _runs(model, limit + 1)
    said = []
    assert fit_positions(model, seq_len, note=said.append) == min(seq_len, limit)
    assert bool(said) == (seq_len > limit) and all(f"samples of {limit} tokens, not {seq_len}" in s for s in said)


@pytest.mark.parametrize("key", ["gpt_neo", "gpt2", "bart", "roberta"])
def test_convert_and_scan_fit_the_positions(key, tmp_path, capsys):
    """`halfsafe convert` and `halfsafe scan` with the default --seq-len 512, and convert with --seq-len 1000, on a
    model of 128 positions: samples of 128 tokens, the note on stderr; a --long-sample of 129 refused, nothing written."""
    make_tiny(key).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    limit = position_limit(make_tiny(key))
    for i, args in enumerate((["convert"], ["convert", "--seq-len", "1000"], ["scan"])):
        capsys.readouterr()
        out = [str(tmp_path / f"out{i}")] if args[0] == "convert" else []
        assert main([args[0], str(tmp_path / "model"), *out, "--max-samples", "1", *args[1:]]) == 0
        err = capsys.readouterr().err
        assert f"note: samples of {limit} tokens, not {args[-1] if len(args) > 1 else 512}" in err, err
        assert "Traceback" not in err and (not out or (tmp_path / f"out{i}" / "halfsafe.json").is_file()), err
    refused(capsys, ["convert", str(tmp_path / "model"), str(tmp_path / "no"), "--max-samples", "1", "--seq-len", "32",
                     "--long-sample", str(limit + 1)], f"use --long-sample {limit} or less")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("key", ["gpt2"])
def test_verify_fits_the_positions(key, tmp_path, capsys):
    """`halfsafe verify` with its default --seq-len 512 on a converted model whose table of 40 positions is shorter
    than the samples and than the greedy prompt and tokens it asks for (16 + 32): samples as long as the table,
    greedy tokens that end with it, each said in a note; the report written, no traceback."""
    for positions in (40,):
        torch.manual_seed(0)
        config = TINY[key]()
        config.max_position_embeddings = positions
        model_class_for(config)(config).to(torch.bfloat16).save_pretrained(tmp_path / f"m{positions}")
        src, out = str(tmp_path / f"m{positions}"), str(tmp_path / f"c{positions}")
        assert main(["convert", src, out, "--max-samples", "1"]) == 0
        capsys.readouterr()
        report = tmp_path / f"v{positions}.json"
        assert main(["verify", src, out, "--max-samples", "1", "--json", str(report)]) == 0
        err = capsys.readouterr().err
        limit = position_limit(model_class_for(config)(config))
        assert f"note: samples of {limit} tokens, not 512" in err and "Traceback" not in err, err
        assert ("greedy tokens, not 32" in err) == (limit < 16 + 32), err
        assert report.is_file()
