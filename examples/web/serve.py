"""Serve the page, transformers.js (clients/js/node_modules) and exported model folders from localhost.

    python examples/web/serve.py OUT-onnx [--port 8000]      then open http://localhost:8000/
    python examples/web/serve.py plain=OUT1-onnx default=OUT2-onnx      then open .../time_steps.html?models=plain,default&...

URL paths: `/` this folder (index.html, app.js; f16_proof.html: does the browser's WebGPU compute in float16?;
time_steps.html: prefill and decode steps of exports timed in turn), `/node_modules/` clients/js/node_modules
(`npm ci --ignore-scripts` there first), `/models/model/` the model folder (`/models/NAME/` each NAME=FOLDER).
Nothing is fetched from elsewhere, and nothing is served from outside those folders: a path that is not plainly
one inside them (not starting with `/`, bad percent-encoding, a control character such as `%00`, a `.` or `..`
segment, over MAX_PATH characters) is answered 400 before any file is looked at.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import sys
import threading
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE_MODULES = HERE.parent.parent / "clients" / "js" / "node_modules"
MAX_PATH = 1024  # characters of a decoded URL path; the page's longest is under 200
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")  # and backslash: no file here has one, and it is a separator elsewhere
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a model's name in /models/NAME/


def bad_path(target: str) -> str | None:
    """Why the request target `target` names no file this server may serve (the 400's message), or None."""
    raw = target.split("?", 1)[0].split("#", 1)[0]
    if not raw.startswith("/"):  # an absolute URL, "*"; http.server has made a leading "//" one "/"
        return "the path must start with /"
    if _BAD_ESCAPE.search(raw):
        return "bad percent-encoding"
    try:
        path = urllib.parse.unquote(raw, errors="strict")
    except UnicodeDecodeError:
        return "the percent-encoded bytes are not UTF-8"
    if len(path) > MAX_PATH:
        return f"the path is over {MAX_PATH} characters"
    if _CONTROL.search(path):
        return "a control character or backslash in the path"
    if any(part in (".", "..") for part in path.split("/")):
        return "a . or .. segment in the path"
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    roots: dict[str, Path] = {}

    def send_head(self):  # GET and HEAD: a malformed path is answered 400, never looked up
        why = bad_path(self.path)
        if why is not None:
            self.send_error(400, why)
            return None
        return super().send_head()

    def translate_path(self, path: str) -> str:
        path = urllib.parse.unquote(path.split("?", 1)[0].split("#", 1)[0])
        for prefix, root in self.roots.items():
            if path.startswith(prefix):
                rest = Path(path[len(prefix):].lstrip("/"))
                target = (root / rest).resolve()
                if target != root and root not in target.parents:  # no ../ out of the served folders
                    return str(root / "__forbidden__")
                return str(target)
        return str(HERE / "__missing__")

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format, *args) -> None:  # quiet: a test reads the page, not the log
        pass


_Handler.extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                           ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}


def make_server(model: Path | dict[str, Path], port: int = 0, name: str = "model") -> http.server.ThreadingHTTPServer:
    """A server (not started) for the page, node_modules and `model` as /models/`name`/ (or each folder of a
    {name: folder} dict as /models/name/); port 0 picks a free one."""
    models = model if isinstance(model, dict) else {name: model}
    bad = [n for n in models if not NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"model name {bad[0]!r:.40}: use letters, digits, - and _")
    roots = {"/node_modules/": NODE_MODULES, **{f"/models/{n}/": Path(f).resolve() for n, f in models.items()}, "/": HERE}
    handler = type("Handler", (_Handler,), {"roots": roots})
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(HERE)))


def serve_in_thread(model: Path | dict[str, Path], name: str = "model") -> tuple[http.server.ThreadingHTTPServer, str]:
    server = make_server(model, name=name)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="+", help="a folder written by `halfsafe export onnx` (served as /models/model/), "
                    "or NAME=FOLDER, one or more (each as /models/NAME/)")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    named = [m.split("=", 1) if "=" in m and NAME.fullmatch(m.split("=", 1)[0]) else ["model", m] for m in args.model]
    models = {n: Path(f) for n, f in named}
    if len(models) != len(named):
        print("two folders under one name: give each NAME=FOLDER its own NAME", file=sys.stderr)
        return 2
    for model in models.values():
        if not (model / "config.json").is_file() or not (model / "onnx").is_dir():
            print(f"{model} is not an exported ONNX folder (config.json + onnx/): give the folder `halfsafe export onnx` wrote", file=sys.stderr)
            return 2
    if not NODE_MODULES.is_dir():
        print(f"{NODE_MODULES} is missing: run `npm ci --ignore-scripts` in {NODE_MODULES.parent}", file=sys.stderr)
        return 2
    server = make_server(models, args.port)
    print(f"serving on http://localhost:{server.server_address[1]}/ (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
