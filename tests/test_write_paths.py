"""Every write path on hostile input: `convert --to onnx` commits OUT once (the ONNX inside) or not at all; an OS error
while writing a checkpoint, an ONNX export, a --json report or a --plot image is one line and leaves nothing
half-written; every option that can be checked before the slow part is (report paths, plot formats, name lengths,
plan and text files, a plan's tensors against the model); paths are printed as they are (no Rich markup read)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hostile import SHORT, copy_of, folder_hash, refused, tiny_plan
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tiny import save_tiny

from halfsafe.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture
def model(src, tmp_path):
    return copy_of(src, tmp_path / "model")


@pytest.fixture
def no_load(monkeypatch):
    """Refusals must come before the model loads (and so before anything slow)."""
    monkeypatch.setattr("halfsafe.io.loading.load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def _leftovers(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*"))


# --- convert --to onnx: OUT appears once, with the ONNX inside, or not at all ---------------------------------------


def test_convert_to_onnx_writes_the_onnx_before_out_is_in_place(src, tmp_path, capsys, monkeypatch):
    """The one real export here: the ONNX is written inside the temporary folder (OUT does not exist yet), the card
    and the report name OUT, and "wrote OUT" comes once everything is in place."""
    import halfsafe.export.onnx as onnx_export

    out = tmp_path / "out"
    real, seen = onnx_export.save_program, []

    def save_program(program, path):
        seen.append((path, out.exists()))
        return real(program, path)

    monkeypatch.setattr(onnx_export, "save_program", save_program)
    capsys.readouterr()
    assert main(["convert", str(src), str(out), *SHORT, "--to", "onnx", "--json", str(tmp_path / "r.json")]) == 0
    assert [exists for _, exists in seen] == [False] and f".{out.name}.tmp-" in str(seen[0][0])  # inside the temporary folder
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote")]
    assert printed == [f"wrote {out} (fp16 checkpoint, halfsafe.json, README.md)",
                       f"wrote {out / 'onnx' / 'model_fp16.onnx'} (fp16 ONNX)", f"wrote {tmp_path / 'r.json'}"]
    assert (out / "onnx" / "model_fp16.onnx").is_file() and (out / "model.safetensors").is_file() and not _leftovers(out)
    card = (out / "README.md").read_text()
    assert f"pipeline('text-generation', '{out.name}')" in card and ".tmp-" not in card  # the card names OUT, not the temporary
    assert [p["name"] for p in json.loads((tmp_path / "r.json").read_text())["phases"]][-2:] == ["write", "export"]


def _stub_graph(monkeypatch, fail):
    """The export without tracing a graph: its save writes part of a file, then `fail(path)`."""
    import halfsafe.export.onnx as onnx_export
    import halfsafe.export.onnx_decoder as decoder

    monkeypatch.setattr(decoder, "programs", lambda model: iter([(onnx_export.ONNX_FILE, None)]))
    monkeypatch.setattr(onnx_export, "split_graph", lambda profile, program, counts=None: None)  # no graph to rewrite

    def save_program(program, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half an onnx file")
        fail(path)

    monkeypatch.setattr(onnx_export, "save_program", save_program)


def _full(path):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("previous", [False, True])
def test_a_full_disk_during_the_onnx_export_leaves_no_out_and_the_old_one_whole(model, tmp_path, capsys, monkeypatch, previous):
    out = tmp_path / "out"
    extra = []
    if previous:  # --overwrite: the old OUT stays whole
        assert main(["convert", str(model), str(out), *SHORT]) == 0  # the old one, whole in the folder hash below
        extra = ["--overwrite"]
    before = folder_hash(tmp_path)
    _stub_graph(monkeypatch, _full)
    capsys.readouterr()
    err = refused(capsys, ["convert", str(model), str(out), *SHORT, "--to", "onnx", *extra], f"could not write {out}",
                  "No space left on device")
    assert "wrote" not in capsys.readouterr().out, err
    assert folder_hash(tmp_path) == before  # no OUT (or the old one, intact), no temporary folder, nothing else


KILL_IN_EXPORT = """
    import os, signal, sys
    import halfsafe.export.onnx as x
    import halfsafe.export.onnx_decoder as decoder
    decoder.programs = lambda model: iter([(x.ONNX_FILE, None)])
    x.split_graph = lambda profile, program, counts=None: None  # no graph to rewrite: the stub's stands for one
    def save_program(program, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half an onnx file")
        os.kill(os.getpid(), signal.SIGKILL)
    x.save_program = save_program
    from halfsafe.cli import main
    sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("previous", [False, True])
def test_a_run_killed_during_the_onnx_export_leaves_no_out_and_the_old_one_whole(model, tmp_path, previous):
    out = tmp_path / "out"
    extra = []
    if previous:
        assert main(["convert", str(model), str(out), *SHORT]) == 0
        extra = ["--overwrite"]
    old = folder_hash(out) if previous else None
    code = textwrap.dedent(KILL_IN_EXPORT).format(argv=["convert", str(model), str(out), *SHORT, "--to", "onnx", *extra])
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert (folder_hash(out) == old) if previous else not out.exists()  # nothing inside OUT: the half file is beside it
    assert _leftovers(out)  # the killed run's temporary folder, which the next run removes
    assert main(["convert", str(model), str(out), *SHORT, "--overwrite"]) == 0
    assert not _leftovers(out) and not (out / "onnx").exists()


def test_a_full_disk_during_export_onnx_is_one_line_and_leaves_nothing(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "onnx-out"
    before = folder_hash(tmp_path)
    _stub_graph(monkeypatch, _full)
    refused(capsys, ["export", "onnx", str(model), str(out)], f"could not write {out}", "No space left on device")
    assert folder_hash(tmp_path) == before


# --- --json and --plot: written whole or not at all, an OS error in one line ------------------------------------------


@pytest.mark.parametrize("option, name", [("--json", "report.json"), ("--plot", "peaks.png")])
def test_a_report_that_cannot_be_written_is_one_line_and_the_old_one_stays(model, tmp_path, capsys, monkeypatch, option, name):
    import halfsafe.io.paths as paths

    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / name).write_text("the previous report")
    before = folder_hash(reports)

    real = os.replace

    def replace(a, b):  # the disk fills up as the report is put in place
        if Path(b) == reports / name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(a, b)

    monkeypatch.setattr(paths.os, "replace", replace)
    refused(capsys, ["scan", str(model), *SHORT, option, str(reports / name)], "could not write", f"{reports / name} (No space left on device)")
    assert folder_hash(reports) == before  # no temporary file left, the previous report whole


# --- every option that can be checked is, right after parsing ----------------------------------------------------


def _refusals(model: Path, tmp: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    blocker = tmp / "a-file"
    blocker.write_text("x")
    os.link(model / "config.json", tmp / "linked.json")
    long = "x" * 300
    out = str(tmp / "out")
    return [
        (["scan", str(model), "--plot", str(tmp / "peaks.xyz")], ("--plot", "cannot write .xyz files", ".png")),
        (["convert", str(model), out, "--plot", str(tmp / "peaks.xyz")], ("cannot write .xyz files",)),
        (["verify", str(model), "--plot", str(tmp / "kl.xyz")], ("cannot write .xyz files",)),
        (["scan", str(model), "--json", str(tmp)], ("--json", "is a folder")),
        (["scan", str(model), "--json", str(blocker / "r.json")], ("--json", "a-file is not a folder")),
        (["scan", str(model), "--json", str(tmp / long)], ("--json", "300 bytes long", "longer than this file system allows")),
        (["scan", str(model), "--plot", str(tmp / (long + ".png"))], ("--plot", "304 bytes long")),
        (["verify", str(model), "--plot", str(tmp / ("x" * 245 + ".png"))], ("--plot", "-layers.png", "256 bytes long")),
        (["convert", str(model), str(tmp / ("o" * 250)), *SHORT], ("output folder", "250 bytes long", "14 characters more")),
        (["export", "onnx", str(model), str(tmp / ("o" * 250))], ("output folder", "250 bytes long")),
        (["scan", str(model), "--json", str(tmp / "linked.json")], ("--json", "hard link to a file of the model")),
        (["scan", str(model), "--json", str(tmp / "r.png"), "--plot", str(tmp / "r.png")], ("--plot", "name the same file")),
        (["scan", str(model), "--json", str(tmp / "p"), "--plot", str(tmp / "p")], ()),  # --plot p is p.png: allowed
        (["convert", str(model), out, "--json", out], ("--json", "is the output folder")),
    ]


def test_report_paths_and_names_are_refused_before_the_model_loads(model, tmp_path, capsys, no_load):
    checks = tmp_path / "checks"
    checks.mkdir()
    for argv, says in _refusals(model, checks):
        argv = argv if argv[0] == "export" else [*argv, *SHORT]
        before = folder_hash(tmp_path)
        if not says:  # allowed: it gets as far as loading
            with pytest.raises(pytest.fail.Exception, match="the model was loaded"):
                main(argv)
            continue
        refused(capsys, argv, *says)
        assert folder_hash(tmp_path) == before, argv


def test_a_plot_format_that_needs_latex_is_refused_where_latex_is_missing(model, tmp_path, capsys, no_load):
    import shutil

    from matplotlib import rcParams

    if shutil.which(rcParams["pgf.texsystem"]):
        pytest.skip("LaTeX is installed here")
    refused(capsys, ["scan", str(model), "--plot", str(tmp_path / "p.pgf")], "--plot", "needs xelatex")


def test_a_plot_name_without_a_suffix_is_a_png_and_the_line_names_it(model, tmp_path, capsys):
    capsys.readouterr()
    assert main(["scan", str(model), *SHORT, "--plot", str(tmp_path / "peaks")]) == 0
    assert (tmp_path / "peaks.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "peaks").exists()
    assert f"wrote {tmp_path / 'peaks.png'}" in capsys.readouterr().out.splitlines()
    assert not list(tmp_path.glob(".halfsafe-*"))


# --- paths printed as they are ------------------------------------------------------------------------------------


def test_paths_with_markup_emoji_and_tex_are_printed_and_written_verbatim(src, tmp_path, capsys, monkeypatch):
    """Rich markup ([red], [/]), emoji codes (:smile:) and TeX ($...$) in a path: no MarkupError, no mangled line, no
    mathtext error in the plot's title."""
    monkeypatch.chdir(tmp_path)
    model = copy_of(src, tmp_path / r"[red]m:smile:$\m$")  # also in the plot's title
    capsys.readouterr()
    assert main(["convert", model.name, "[bold]o:smile:", *SHORT, "--json", "[/]r.json", "--plot", r"$\foo$[i].png"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "wrote [bold]o:smile: (fp16 checkpoint, halfsafe.json, README.md)" in out
    assert "wrote [/]r.json" in out and r"wrote $\foo$[i].png" in out
    assert Path("[bold]o:smile:/halfsafe.json").is_file() and Path("[/]r.json").is_file() and Path(r"$\foo$[i].png").is_file()
    capsys.readouterr()
    assert main(["scan", model.name, *SHORT]) == 0
    assert f"Residual stream per layer: {model.name}" in capsys.readouterr().out  # the table's title


NAME = st.text(st.sampled_from("[]/:$\\ab_ -*~@#."), min_size=1, max_size=24).filter(
    lambda s: not s.endswith("/") and "//" not in s and not {".", ".."} & set(s.split("/")))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAME)
@example(name="[red]x:smile:[/]")
@example(name="two  spaces")
def test_any_path_is_printed_verbatim_in_the_one_line_error(tmp_path, capsys, name):
    missing = f"{tmp_path}/m{name}"
    refused(capsys, ["scan", missing, *SHORT], missing, "does not exist")


@settings(max_examples=25, deadline=None)
@given(text=st.text(st.sampled_from("[]/:$\\ab_ -*~@#.smile"), min_size=1, max_size=40))
@example(text="[red]x:smile:[/]")
@example(text="/a/long/path/" + "x" * 200 + " [b]y")  # longer than the console: not wrapped
def test_any_path_is_printed_verbatim_in_a_wrote_line(text):
    from halfsafe import cli

    with cli.console.capture() as captured:
        cli._say(f"wrote {text}")
    assert captured.get() == f"wrote {text}\n"


# --- input files: regular files only, read only as far as needed ----------------------------------------------------


@pytest.fixture
def fifo(tmp_path):
    """A FIFO; a reader that blocks on it is let go after 20 s (and the test fails on what it then says)."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    done = threading.Event()

    def release():
        if not done.wait(20):
            fd = os.open(path, os.O_WRONLY)  # the blocked reader gets an empty file
            os.close(fd)

    threading.Thread(target=release, daemon=True).start()
    yield path
    done.set()


@pytest.mark.parametrize("what, says", [("fifo", "is a FIFO (named pipe), not a file"), ("/dev/zero", "is a device"),
                                        ("/dev/null", "is a device"), ("folder", "is a folder")])
def test_a_text_that_is_not_a_regular_file_is_refused_as_what_it_is(model, tmp_path, capsys, no_load, request, what, says):
    path = request.getfixturevalue("fifo") if what == "fifo" else tmp_path if what == "folder" else Path(what)
    for command in (["scan", str(model)], ["convert", str(model), str(tmp_path / "out")], ["verify", str(model)]):
        refused(capsys, [*command, "--text", str(path), *SHORT], f"text file {path} {says}")
    assert not (tmp_path / "out").exists()


def test_a_plan_or_a_training_state_that_is_a_fifo_is_refused_without_hanging(model, tmp_path, capsys, fifo, no_load):
    refused(capsys, ["apply", str(fifo), str(model), str(tmp_path / "out"), *SHORT], f"cannot read a plan from {fifo}",
            "a FIFO (named pipe)")
    refused(capsys, ["finetune", str(model), str(tmp_path / "out"), "--resume-from", str(fifo), *SHORT],
            f"--resume-from {fifo} is a FIFO")
    refused(capsys, ["apply", "/dev/zero", str(model), str(tmp_path / "out"), *SHORT], "a device")


def test_a_large_text_is_read_only_as_far_as_the_samples_need(model, tmp_path, capsys, monkeypatch):
    """32 tokens from a 64 MB file: a few kB read. (The bytes after its start are not UTF-8: a whole read refuses it.)"""
    import halfsafe.calibration as calibration

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(("Some calibration text, line by line.\n" * 400).encode())
        f.seek(32 << 20)
        f.write(b"\xff\xfe not UTF-8")
        f.truncate(64 << 20)  # sparse
    real, limits = calibration.TextFile.read, []

    def read(self, limit=None):
        limits.append(limit)
        return real(self, limit)

    monkeypatch.setattr(calibration.TextFile, "read", read)
    assert main(["scan", str(model), "--text", str(big), *SHORT, "--json", str(tmp_path / "r.json")]) == 0
    assert limits and None not in limits and max(limits) < 1 << 20, limits
    assert json.loads((tmp_path / "r.json").read_text())["n_tokens"] == 32


@settings(max_examples=30, deadline=None)
@given(text=st.text(st.sampled_from("ab c\n\r\u00e9\u4e2d"), min_size=1, max_size=600), seq_len=st.integers(2, 40),
       max_samples=st.one_of(st.none(), st.integers(1, 6)), per_token=st.integers(1, 3), margin=st.integers(0, 4))
def test_samples_cut_from_a_prefix_are_those_of_the_whole_text(tmp_path_factory, text, seq_len, max_samples, per_token, margin):
    """Read in growing prefixes (tiny here, to grow often), a file gives the samples its whole text gives."""
    import halfsafe.calibration as calibration
    from halfsafe.calibration import TextFile, make_samples

    path = tmp_path_factory.mktemp("text") / "t.txt"
    path.write_bytes(text.encode())
    whole = path.read_text(encoding="utf-8")
    try:
        want = make_samples([whole], None, 300, seq_len, max_samples)
    except Exception as e:
        want = type(e)
    old = calibration.BYTES_PER_TOKEN, calibration.MARGIN_TOKENS
    calibration.BYTES_PER_TOKEN, calibration.MARGIN_TOKENS = per_token, margin
    try:
        got = make_samples([TextFile(path)], None, 300, seq_len, max_samples)
    except Exception as e:
        got = type(e)
    finally:
        calibration.BYTES_PER_TOKEN, calibration.MARGIN_TOKENS = old
    if isinstance(want, type):
        assert got is want
    else:
        assert [s.tolist() for s in got] == [s.tolist() for s in want]


# --- apply: a plan that does not fit the model, refused right after loading ----------------------------------------


@pytest.fixture
def no_calibration(monkeypatch):
    monkeypatch.setattr("halfsafe.calibration.make_samples", lambda *a, **k: pytest.fail("calibration ran"))


def test_a_plan_with_a_wrong_shape_is_refused_before_calibration(model, tmp_path, capsys, no_calibration):
    plan = tiny_plan()
    plan["tensors"][0]["shape"] = [7, 7]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    refused(capsys, ["apply", str(tmp_path / "plan.json"), str(model), str(tmp_path / "out"), *SHORT],
            f"{plan['tensors'][0]['param']} is", "[7, 7] in the plan")
    assert not (tmp_path / "out").exists()


PARAM = st.from_regex(r"model\.layers\.[0-9]{1,3}\.(mlp|self_attn|zz)\.[a-z_]{1,12}\.weight", fullmatch=True)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=PARAM)
def test_a_plan_naming_a_tensor_the_model_lacks_is_refused_before_calibration(src, tmp_path, capsys, no_calibration, name):
    from tiny import make_tiny

    if name in dict(make_tiny("llama").named_parameters()):
        return
    plan = tiny_plan()
    plan["tensors"].append(dict(plan["tensors"][0], param=name))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    refused(capsys, ["apply", str(path), str(src), str(tmp_path / "never"), *SHORT], f"the plan moves {name}, which this model does not have")
    assert not (tmp_path / "never").exists()
