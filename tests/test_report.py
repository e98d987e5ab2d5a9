"""halfsafe.json as one typed record (io.report) and the model card made from it (io.card): what convert and apply
write reads back as the same record, which writes the same bytes again, card included; a record from a newer
halfsafe, or a file that is not one, is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from stress import make_stress
from tiny import make_tiny

from halfsafe.calibration import default_text, make_samples
from halfsafe.cli import main
from halfsafe.core.forward import logits
from halfsafe.errors import HalfsafeError
from halfsafe.io import card, report
from halfsafe.io.report import FILE, RECORD_FORMAT, Applied, Conversion, Record

ARGS = ["--seq-len", "32", "--max-samples", "2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A stressed tiny Llama converted, and its plan applied to a nudged copy: {"convert": folder, "apply": folder}."""
    root = tmp_path_factory.mktemp("record")
    model = make_tiny("llama")
    calib = make_samples([default_text()], None, 256, 32, 2)
    make_stress(model, lambda: [logits(model, ids) for ids in calib])
    model.save_pretrained(root / "base")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.001)
    model.save_pretrained(root / "nudged")
    assert main(["convert", str(root / "base"), str(root / "convert"), *ARGS]) == 0
    assert main(["apply", str(root / "convert"), str(root / "nudged"), str(root / "apply"), *ARGS]) == 0
    return {"convert": root / "convert", "apply": root / "apply"}


@pytest.mark.parametrize("kind, section", [("convert", Conversion), ("apply", Applied)])
def test_what_is_written_reads_back_and_writes_the_same_bytes(written, kind, section, tmp_path):
    folder = written[kind]
    record = report.read(folder)
    assert isinstance(record.conversion if kind == "convert" else record.applied, section)
    assert record.source.endswith("base" if kind == "convert" else "nudged") and record.plan.tensors
    report.write(tmp_path, record)
    card.write(tmp_path, record)  # the source had no card: the section alone
    for name in (FILE, card.FILE):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), name


def test_the_card_says_what_the_record_says(written):
    record, text = report.read(written["convert"]), (written["convert"] / card.FILE).read_text()
    assert card.TITLE in text and f"tensors rescaled: {len(record.plan.tensors)};" in text
    assert f"activation peak before: {record.conversion.peak_before:.4g}" in text and record.conversion.margin.rule in text
    applied = (written["apply"] / card.FILE).read_text()  # apply measures none of convert's numbers
    assert "activation peak before: nan" in applied and "fp16 finite = None" in applied


def test_format_one_is_written_without_the_field_and_a_newer_one_is_refused(written, tmp_path):
    d = json.loads((written["convert"] / FILE).read_text())
    assert "format" not in d and RECORD_FORMAT == 1 and Record.from_dict(d).format == 1
    (tmp_path / FILE).write_text(json.dumps({**d, "format": RECORD_FORMAT + 1}))
    with pytest.raises(HalfsafeError, match=f"format {RECORD_FORMAT + 1}.*upgrade halfsafe"):
        report.read(tmp_path)


@pytest.mark.parametrize("broken, says", [
    ([], "not an object with a plan"),
    ({"source": "x"}, "not an object with a plan"),
    ({"format": "2", "plan": {}}, "format is '2'"),
    ("drop peaks_before", "TypeError"),
    ("drop scan_after", "KeyError"),
])
def test_a_file_that_is_not_a_record_is_refused_in_one_line(written, tmp_path, broken, says):
    if isinstance(broken, str):
        key = broken.split()[1]
        d = json.loads((written["convert" if key == "peaks_before" else "apply"] / FILE).read_text())
        del d[key]
        broken = d
    (tmp_path / FILE).write_text(json.dumps(broken))
    with pytest.raises(HalfsafeError, match=f"^not a halfsafe.json halfsafe wrote .*{says}"):
        report.read(tmp_path)
    with pytest.raises(HalfsafeError, match="cannot read"):
        report.read(tmp_path / "missing")


def test_a_record_holds_a_conversion_or_an_applied_plan(written):
    record = report.read(written["apply"])
    with pytest.raises(ValueError):
        Record("x")
    with pytest.raises(ValueError):
        Record("x", conversion=report.read(written["convert"]).conversion, applied=record.applied)
