"""examples/web/serve.py on 127.0.0.1, asked with raw HTTP: a malformed path (`%00`, `..`, bad percent-encoding, a
very long one, an absolute URL) is answered 400 and the connection is not dropped; no path, however built, serves a
file from outside the page's folder, node_modules and the model folder."""

from __future__ import annotations

import socket
import sys
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "web"))
from serve import serve_in_thread  # noqa: E402

SECRET = b"outside-the-served-folders"
MALFORMED = [b"/%00", b"/models/model/config.json%00.html", b"/models/model/%00", b"/models/model/../secret.txt",
             b"/models/model/..%2f..%2fsecret.txt", b"/models/model/%2e%2e/secret.txt", b"/%2E%2E/%2e%2e/etc/passwd",
             b"/./index.html", b"/" + b"a" * 5000, b"/models/model/" + b"%41" * 2000, b"/%zz", b"/%", b"/index.html%4",
             b"/%e9", b"/%c0%af", b"/models/model/config.json%0d%0aSet-Cookie:%20x=1", b"/models/model/..%5csecret.txt",
             b"http://127.0.0.1/index.html", b"*", b"index.html"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(port, errors): the server serves a model folder beside a secret file; errors: tracebacks of its handlers."""
    root = tmp_path_factory.mktemp("web")
    (root / "secret.txt").write_bytes(SECRET)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text('{"model_type": "gemma3_text"}')
    (root / "model" / "outside").symlink_to(root / "secret.txt")
    srv, _ = serve_in_thread(root / "model")
    errors: list[str] = []
    srv.handle_error = lambda request, address: errors.append(traceback.format_exc())
    yield srv.server_address[1], errors
    srv.shutdown()
    srv.server_close()


def ask(port: int, target: bytes, method: bytes = b"GET") -> tuple[int, bytes]:
    """The status and the whole response to one raw request."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    assert data.startswith(b"HTTP/1."), f"no answer to {target[:80]!r}: the connection was dropped"
    return int(data.split(b" ", 2)[1]), data


def test_the_page_and_the_model_are_served(server):
    port, errors = server
    status, data = ask(port, b"/models/model/config.json")
    assert status == 200 and data.endswith(b'{"model_type": "gemma3_text"}')
    assert ask(port, b"/index.html")[0] == 200 and ask(port, b"/?lib=tjs3")[0] == 200
    assert ask(port, b"/models/model/nothing.json")[0] == 404 and not errors


@pytest.mark.parametrize("target", MALFORMED, ids=lambda t: repr(t[:40]))
@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
def test_a_malformed_path_is_answered_400(server, target, method):
    port, errors = server
    status, data = ask(port, target, method)
    assert status == 400 and SECRET not in data and not errors, (data[:300], errors)


def test_a_link_out_of_the_model_folder_is_not_followed(server):
    port, errors = server
    status, data = ask(port, b"/models/model/outside")
    assert status == 404 and SECRET not in data and not errors


SEGMENTS = ["..", ".", "%2e%2e", "%2E.", ".%2e", "%00", "%", "%zz", "%c0%af", "%ff", "%2f", "%5c", "\\", "secret.txt",
            "models", "model", "outside", "config.json", "index.html", "node_modules", "", "~", "a" * 300, "%0a", "?x=/.."]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=8), lead=st.sampled_from(["/", "", "//", "/models/model/"]))
def test_no_path_serves_outside_the_folders_or_drops_the_connection(server, parts, lead):
    port, errors = server
    target = (lead + "/".join(parts)).encode()
    assume(target)  # an empty target makes an HTTP/0.9 request line, whose answer has no status line
    status, data = ask(port, target)
    assert status in (200, 301, 400, 404) and SECRET not in data and not errors, (status, data[:300], errors)


def test_named_models_are_served_each_under_its_name(tmp_path):
    """serve.py NAME=FOLDER ...: each folder as /models/NAME/ (time_steps.html times two exports in one page)."""
    for name in ("plain", "default"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"name": "{name}"}}')
    srv, _ = serve_in_thread({"plain": tmp_path / "plain", "default": tmp_path / "default"})
    try:
        port = srv.server_address[1]
        for name in ("plain", "default"):
            status, data = ask(port, f"/models/{name}/config.json".encode())
            assert status == 200 and data.endswith(f'{{"name": "{name}"}}'.encode())
        assert ask(port, b"/models/model/config.json")[0] == 404 and ask(port, b"/time_steps.html")[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("name", ["", "a/b", "..", ".", "a b", "a" * 65, "m\x00", "é", "a%2fb"])
def test_a_model_name_that_is_not_one_path_segment_is_refused(tmp_path, name):
    from serve import make_server

    with pytest.raises(ValueError, match="model name"):
        make_server({name: tmp_path})


@pytest.mark.parametrize("argv", [["a={e}", "a={e}"], ["{e}", "{e}"], ["a={e}", "b={bad}"]],
                         ids=["one name twice", "two unnamed", "not an export"])
def test_the_cli_refuses_bad_folders_in_one_line(tmp_path, argv):
    import subprocess

    export, bad = tmp_path / "export", tmp_path / "bad"
    (export / "onnx").mkdir(parents=True)
    (export / "config.json").write_text("{}")
    bad.mkdir()
    serve = Path(__file__).resolve().parent.parent / "examples" / "web" / "serve.py"
    done = subprocess.run([sys.executable, str(serve), *(a.format(e=export, bad=bad) for a in argv)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and not done.stdout, done.stderr
