"""No path a command writes (OUT, --json, --plot and verify's -layers plot) may name what the same command reads: the
model and every file under its folder, CONVERTED, --tokenizer, each --text, apply's plan, --resume-from. Not by the
same name, a symbolic link anywhere along the path (to the file or to a folder above it), `..` and `.` components,
a hard link, nor a folder that holds one of them; nor may two outputs of one command be one file, or a report lie in
OUT. Each is refused in one line by the real command line right after parsing (the model is never loaded), and what
is read keeps its bytes. (Reports inside the model: tests/test_safety.py; report paths' other checks:
tests/test_write_paths.py.)"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hostile import SHORT, copy_of, folder_hash, refused
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import save_tiny

from halfsafe.cli import main

PROPERTY = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "out"
    assert main(["convert", str(src), str(out), *SHORT]) == 0
    return out


@pytest.fixture
def no_load(monkeypatch):
    """Every refusal comes before the model loads; a path that is allowed gets as far as loading, and no further."""
    def load(*a, **k):
        raise _Loaded()

    monkeypatch.setattr("halfsafe.io.loading.load_model", load)


class _Loaded(Exception):
    pass


def _allowed(argv: list[str]) -> None:
    """`halfsafe ARGV` passes every path check: it reaches the model's load."""
    with pytest.raises(_Loaded):
        main(argv)


def _calibration(root: Path) -> Path:
    text = root / "texts" / "calib.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text("the calibration text, kept as it is. " * 20)
    return text


# --- each command, each input it reads ----------------------------------------------------------------------------


def _cases(model: Path, converted: Path, root: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    text = _calibration(root)
    plan = root / "plans" / "plan.json"
    plan.parent.mkdir()
    shutil.copy2(converted / "halfsafe.json", plan)
    state = root / "states" / "finetune_state.pt"
    state.parent.mkdir()
    state.write_bytes(b"a training state")
    tok = copy_of(model, root / "tok")
    prior = shutil.copytree(converted, root / "prior")  # an OUT of an earlier run, holding an input of this one
    shutil.copy2(text, prior / "notes.txt")
    linked = shutil.copytree(converted, root / "linked")  # an OUT holding another name of the text
    os.link(text, linked / "calib-link.txt")
    os.link(text, root / "linked.txt")
    (root / "to-text.json").symlink_to(text)
    (root / "to-texts").symlink_to(text.parent, target_is_directory=True)
    m, t, out = str(model), str(text), str(root / "out")
    return [
        (["scan", m, "--text", t, "--json", t], ("--json", "is the text file", "never writes over")),  # the reported bug
        (["scan", m, "--text", t, "--json", str(root / "linked.txt")], ("--json", "hard link to the text file")),
        (["scan", m, "--text", t, "--json", str(root / "to-text.json")], ("is the text file",)),
        (["scan", m, "--text", t, "--json", str(root / "to-texts" / "calib.txt")], ("is the text file",)),
        (["scan", m, "--text", str(root / "to-texts" / "calib.txt"), "--json", t], ("is the text file",)),
        (["scan", m, "--text", t, "--json", str(text.parent / ".." / "texts" / "." / "calib.txt")], ("is the text file",)),
        (["scan", m, "--tokenizer", str(tok), "--json", str(tok / "tokenizer.json")], ("inside the tokenizer folder",)),
        (["scan", m, "--tokenizer", str(tok), "--json", str(tok / "config.json")], ("inside the tokenizer folder",)),
        (["scan", m, "--json", str(root / "r.svg"), "--plot", str(root / "r.svg")], ("name the same file",)),
        (["convert", m, out, "--text", t, "--json", str(root / "texts")], ("--json", "folder that holds the text file")),
        (["convert", m, str(text.parent), "--text", t, "--overwrite"], ("folder that holds the text file",)),
        (["convert", m, str(prior), "--text", str(prior / "notes.txt"), "--overwrite"], ("folder that holds the text file",)),
        (["convert", m, out, "--text", t, "--json", str(root / "linked.txt")], ("hard link to the text file",)),
        (["convert", m, str(linked), "--text", t, "--overwrite"], ("holds calib-link.txt, which is a hard link to the text",)),
        (["convert", m, out, "--json", str(root / "out" / "r.json")], ("--json", "inside the output folder")),
        (["convert", m, out, "--plot", str(root / "p.png"), "--json", str(root / "p.png")], ("name the same file",)),
        (["convert", m, out, "--tokenizer", str(tok), "--json", str(tok / "r.json")], ("inside the tokenizer folder",)),
        (["apply", str(prior / "halfsafe.json"), m, str(prior), "--overwrite"], ("folder that holds the plan",)),
        (["apply", str(prior), m, str(prior), "--overwrite"], ("is the plan",)),
        (["apply", str(plan), m, str(plan.parent), "--overwrite"], ("folder that holds the plan",)),
        (["finetune", m, out, "--resume-from", str(state), "--json", str(state)], ("--json", "is the training state")),
        (["finetune", m, str(state.parent), "--resume-from", str(state), "--overwrite"], ("holds the training state",)),
        (["finetune", m, out, "--text", t, "--json", t], ("is the text file",)),
        (["verify", m, str(converted), "--json", str(converted / "halfsafe.json")], ("inside the converted folder",)),
        (["verify", m, "--text", t, "--json", t], ("is the text file",)),
        (["verify", m, "--text", t, "--plot", str(root / "texts" / "calib.txt")], ("cannot write .txt files",)),
        (["verify", m, "--json", str(root / "kl-layers.png"), "--plot", str(root / "kl.png")], ("name the same file",)),
        (["export", "onnx", str(converted), out, "--json", str(converted / "config.json")], ("inside the converted folder",)),
        (["export", "onnx", str(converted), str(converted / "web")], ("inside the converted folder",)),
    ]


def test_no_output_names_an_input_of_the_same_command(src, converted, tmp_path, capsys, no_load):
    model = copy_of(src, tmp_path / "model")
    root = tmp_path / "root"
    root.mkdir()
    for argv, says in _cases(model, converted, root):
        argv = argv if argv[0] == "export" else [*argv, *SHORT]
        before = (folder_hash(root), folder_hash(model), folder_hash(converted))
        try:
            refused(capsys, argv, *says)
        except _Loaded:
            pytest.fail(f"allowed: {argv}")
        assert (folder_hash(root), folder_hash(model), folder_hash(converted)) == before, argv


def test_the_reported_case_was_a_real_loss(src, tmp_path, capsys):
    """`halfsafe scan M --text calib.txt --json calib.txt`, run for real: refused, the text as it was; the same report
    beside it is written."""
    text = _calibration(tmp_path)
    before = text.read_bytes()
    refused(capsys, ["scan", str(src), "--text", str(text), "--json", str(text), *SHORT], "is the text file")
    assert text.read_bytes() == before
    assert main(["scan", str(src), "--text", str(text), "--json", str(tmp_path / "report.json"), *SHORT]) == 0
    assert text.read_bytes() == before and (tmp_path / "report.json").is_file()


def test_unrelated_paths_are_allowed(src, converted, tmp_path, no_load):
    text = _calibration(tmp_path)
    reports = tmp_path / "reports"
    _allowed(["scan", str(src), "--text", str(text), "--json", str(reports / "calib.txt"), "--plot", str(reports / "p"), *SHORT])
    _allowed(["convert", str(src), str(tmp_path / "out"), "--text", str(text), "--json", str(tmp_path / "out.json"), *SHORT])
    _allowed(["verify", str(src), str(converted), "--text", str(text), "--json", str(reports / "v.json"), *SHORT])


# --- properties: any way of naming an input --------------------------------------------------------------------------

NAME = st.text(st.sampled_from("abcXYZ019-_. "), min_size=1, max_size=12).filter(lambda s: s.strip(". ") == s and s not in (".", ".."))
FORMS = ["same", "link to it", "link to its folder", "link to a folder above", "hard link", "dot-dot", "dot", "relative",
         "link chain"]


def _name_it(form: str, target: Path, root: Path, scratch: Path) -> str:
    """A path to `target` (a file under `root`) in the given form; links are made in `scratch`, named with the
    target's suffix (--plot adds .png to a name without one)."""
    rel, ext = target.relative_to(root), target.suffix
    if form == "same":
        return str(target)
    if form == "link to it":
        (scratch / f"l{ext}").symlink_to(target)
        return str(scratch / f"l{ext}")
    if form == "link to its folder":
        (scratch / "d").symlink_to(target.parent, target_is_directory=True)
        return str(scratch / "d" / target.name)
    if form == "link to a folder above":
        (scratch / "r").symlink_to(root, target_is_directory=True)
        return str(scratch / "r" / rel)
    if form == "hard link":
        os.link(target, scratch / f"h{ext}")
        return str(scratch / f"h{ext}")
    if form == "dot-dot":
        return str(target.parent / ".." / target.parent.name / target.name)
    if form == "dot":
        return str(root / "." / rel.parent / "." / target.name)
    if form == "relative":
        return os.path.relpath(target)
    if form == "link chain":
        (scratch / "c2").symlink_to(target)
        (scratch / f"c1{ext}").symlink_to(scratch / "c2")
        return str(scratch / f"c1{ext}")
    raise AssertionError(form)


@PROPERTY
@given(names=st.lists(NAME, min_size=1, max_size=3, unique=True), sub=st.booleans(), pick=st.integers(0, 10),
       form=st.sampled_from(FORMS), option=st.sampled_from(["--json", "--plot"]), command=st.sampled_from(["scan", "verify"]),
       of_model=st.booleans())
def test_any_name_for_an_input_is_refused_as_a_report(src, names, sub, pick, form, option, command, of_model):
    """A set of input files (texts, and the model's own files), and a report path that is one of them in any form: refused
    in one line before anything loads, every input's bytes as they were. The same report beside them is allowed."""
    import halfsafe.io.loading as loading

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "in"
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        model = copy_of(src, Path(tmp) / "model")
        texts = []
        for i, name in enumerate(names):
            path = root / ("nested" if sub and i else "") / (name + (".png" if option == "--plot" else ""))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"text {i}: " + "words " * 10)
            texts.append(path)
        option = "--json" if of_model else option  # (a --plot named like the model's .json files is refused for its suffix)
        target = sorted(model.iterdir())[pick % 3] if of_model else texts[pick % len(texts)]
        base = model if of_model else root
        argv = [command, str(model), *[a for t in texts for a in ("--text", str(t))], *SHORT]
        before = (folder_hash(root), folder_hash(model))
        cwd = os.getcwd()
        os.chdir(tmp)
        real, loading.load_model = loading.load_model, _refuse_load
        try:
            named = _name_it(form, target, base, scratch)
            code = _code([*argv, option, named])
            assert code == 2, (form, named)
            assert (folder_hash(root), folder_hash(model)) == before, (form, named)
            with pytest.raises(_Loaded):  # an unrelated report path: allowed
                main([*argv, option, str(Path(tmp) / "reports" / ("r.png" if option == "--plot" else "r.json"))])
        finally:
            loading.load_model = real
            os.chdir(cwd)


def _refuse_load(*a, **k):
    raise _Loaded()


def _code(argv: list[str]) -> int:
    try:
        return main(argv)
    except _Loaded:
        return 0  # it got as far as loading: the path was allowed


def _name_folder(form: str, folder: Path, scratch: Path) -> str:
    """A path to `folder` in the given form; links are made in `scratch`."""
    if form == "same":
        return str(folder)
    if form == "link to it":
        (scratch / "l").symlink_to(folder, target_is_directory=True)
        return str(scratch / "l")
    if form == "link to a folder above":
        (scratch / "r").symlink_to(folder.parent, target_is_directory=True)
        return str(scratch / "r" / folder.name)
    if form == "dot-dot":
        return str(folder / ".." / folder.name)
    if form == "dot":
        return str(folder.parent / "." / folder.name / ".")
    if form == "relative":
        return os.path.relpath(folder)
    if form == "link chain":
        (scratch / "c2").symlink_to(folder, target_is_directory=True)
        (scratch / "c1").symlink_to(scratch / "c2")
        return str(scratch / "c1")
    raise AssertionError(form)


FOLDER_FORMS = ["same", "link to it", "link to a folder above", "dot-dot", "dot", "relative", "link chain"]


@PROPERTY
@given(form=st.sampled_from(FOLDER_FORMS), depth=st.integers(0, 2), up=st.integers(0, 2),
       which=st.sampled_from(["a text's folder", "the model", "inside the model"]))
def test_any_name_for_a_folder_holding_an_input_is_refused_as_out(src, form, depth, up, which):
    """OUT (with --overwrite) that is, holds or lies in the folder of a text or the model, named in any form: refused
    in one line before anything loads; the inputs unchanged."""
    import halfsafe.io.loading as loading

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "in"
        text = root.joinpath(*["deeper"] * depth, "calib.txt")
        text.parent.mkdir(parents=True)
        text.write_text("words " * 20)
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        model = copy_of(src, Path(tmp) / "model")
        before = (folder_hash(root), folder_hash(model))
        folder = {"a text's folder": text.parents[min(up, depth)], "the model": model, "inside the model": model / "out"}[which]
        cwd = os.getcwd()
        os.chdir(tmp)
        real, loading.load_model = loading.load_model, _refuse_load
        try:
            named = _name_folder(form, folder, scratch)
            assert _code(["convert", str(model), named, "--text", str(text), "--overwrite", *SHORT]) == 2, (form, named)
            assert (folder_hash(root), folder_hash(model)) == before
            with pytest.raises(_Loaded):  # a folder beside them: allowed
                main(["convert", str(model), str(Path(tmp) / "out"), "--text", str(text), "--overwrite", *SHORT])
        finally:
            loading.load_model = real
            os.chdir(cwd)


def test_the_python_api_keeps_out_off_what_it_reads_too(src, converted, tmp_path, monkeypatch):
    """apply_checkpoint, finetune_checkpoint and a text read by halfsafe.calibration.read_texts: OUT (replaced with
    overwrite) may not hold the plan, the state or the text (halfsafe.job.Options.reads), before anything loads."""
    from halfsafe.calibration import read_texts
    from halfsafe.convert import apply_checkpoint, convert_checkpoint
    from halfsafe.errors import HalfsafeError
    from halfsafe.training.finetune import finetune_checkpoint

    monkeypatch.setattr("halfsafe.io.loading.load_model", _refuse_load)
    out = shutil.copytree(converted, tmp_path / "out")
    (out / "state.pt").write_bytes(b"a training state")
    (out / "calib.txt").write_text("words " * 20)
    before = folder_hash(out)
    with pytest.raises(HalfsafeError, match="holds the plan"):
        apply_checkpoint(str(out / "halfsafe.json"), str(src), str(out), overwrite=True, progress=False)
    with pytest.raises(HalfsafeError, match="holds the training state"):
        finetune_checkpoint(str(src), str(out), overwrite=True, resume_from=str(out / "state.pt"), progress=False)
    with pytest.raises(HalfsafeError, match="holds the text file"):
        convert_checkpoint(str(src), str(out), texts=read_texts([out / "calib.txt"]), overwrite=True, progress=False)
    assert folder_hash(out) == before
