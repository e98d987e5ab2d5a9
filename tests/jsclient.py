"""transformers.js in Node, as the tests and bench/ run it: clients/js (pinned versions, `npm ci --ignore-scripts`)
and a tiny character-level tokenizer that both transformers and transformers.js load.

`npm ci` runs once per package-lock.json (a stamp in node_modules); onnxruntime-node's postinstall is skipped
because it downloads from a host CI cannot reach, and its CPU binaries are in the npm package anyway.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import string
import subprocess
from pathlib import Path

CLIENTS = Path(__file__).resolve().parent.parent / "clients" / "js"
VERSIONS = ("tjs3", "tjs4")  # npm aliases in clients/js/package.json: transformers.js 3.8.1 and 4.3.2


def node_missing() -> str | None:
    """Why the client cannot run here (a skip reason), or None."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node/npm not installed (Node 20: apt-get install nodejs npm)"
    return None


def chromium_missing() -> str | None:
    """Why the web page cannot run here (a skip reason), or None."""
    if shutil.which("chromium") is None:
        return ("Debian's chromium not installed (scripts/test installs it when run as root with apt-get; "
                "else apt-get install chromium)")
    return node_missing()


def node_version() -> str:
    return subprocess.run(["node", "--version"], capture_output=True, text=True, check=True).stdout.strip()


def chromium_version() -> str:
    exe = shutil.which("chromium") or "/usr/bin/chromium"
    return subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def install() -> Path:
    """clients/js/node_modules, installed from the lock file once (again when the lock file changes)."""
    lock = CLIENTS / "package-lock.json"
    stamp = CLIENTS / "node_modules" / ".halfsafe-lock"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == digest):
        subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=CLIENTS, check=True,
                       capture_output=True, timeout=600)
        stamp.write_text(digest)
    return CLIENTS / "node_modules"


def run(folder, lib: str, *, prompt: str | None = None, ids: list[int] | None = None, new_tokens: int = 16,
        task: str = "text-generation", logits_out=None, pipeline_out=None, timeout: float = 600,
        device: str | None = None, env: dict | None = None, forwards: int = 1) -> dict:
    """clients/js/run.mjs on an exported folder: the pipeline's text, generate()'s greedy tokens, one forward's logits."""
    install()
    args = {"folder": str(folder), "lib": lib, "new_tokens": new_tokens, "task": task, "forwards": forwards}
    if prompt is not None:
        args["prompt"] = prompt
    if ids is not None:
        args["ids"] = [int(i) for i in ids]
    if logits_out is not None:
        args["logits_out"] = str(logits_out)
    if pipeline_out is not None:
        args["pipeline_out"] = str(pipeline_out)
    if device is not None:
        args["device"] = device
    done = subprocess.run(["node", str(CLIENTS / "run.mjs"), json.dumps(args)], cwd=CLIENTS, capture_output=True,
                          text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"transformers.js ({lib}) failed on {folder}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def browser(url: str, timeout: float = 300, mode: str = "wasm", chromium: str | None = None, env: dict | None = None) -> dict:
    """clients/js/browser.mjs: `url` in headless Chromium; what the page reports (window.halfsafeResult) and its console.
    mode "webgpu": WebGPU on the Vulkan driver `env` names, in `chromium` (tests/browser_webgpu.py gives both)."""
    install()
    args = [url, str(int(timeout * 1000)), chromium or shutil.which("chromium"), mode]
    done = subprocess.run(["node", str(CLIENTS / "browser.mjs"), *args], cwd=CLIENTS, capture_output=True, text=True,
                          timeout=timeout + 60, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"headless Chromium failed on {url}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# A tiny tokenizer: one token per character, Gemma's shape (spaces as "▁", <bos> added by the post-processor)
# ----------------------------------------------------------------------------------------------------------------


def save_char_tokenizer(folder, config) -> None:
    """tokenizer.json + tokenizer_config.json for a tiny model of `config.vocab_size` (256): its special tokens at
    the config's ids, the printable characters, and filler tokens up to the vocabulary size. No `add_bos_token` in
    tokenizer_config.json (as in the real Gemma 3's), though the post-processor adds <bos> (a decoder's) or </s>
    after the text (an encoder-decoder's, as T5's)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = text.vocab_size
    special = {}
    for name in ("pad", "eos", "bos", "unk"):
        i = getattr(text, f"{name}_token_id", None)
        if isinstance(i, list):
            i = i[0]
        if i is not None and i not in special.values():
            special[f"<{name}>"] = i
    free = iter(i for i in range(vocab_size) if i not in special.values())
    if "<unk>" not in special:
        special["<unk>"] = next(free)
    chars = ["▁"] + [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]
    vocab = dict(special)
    for c in chars:
        vocab[c] = next(free)
    for i in free:
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    if "<bos>" in special and not getattr(config, "is_encoder_decoder", False):
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", special["<bos>"])])
    elif "<eos>" in special:  # T5's: </s> after the text
        tok.post_processor = processors.TemplateProcessing(single="$A <eos>", pair="$A <eos> $B <eos>",
                                                           special_tokens=[("<eos>", special["<eos>"])])
    tokens = {f"{name}_token": f"<{name}>" for name in ("pad", "eos", "bos", "unk") if f"<{name}>" in special}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    fast.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config_json = json.loads(path.read_text())
    for key in ("add_bos_token", "add_eos_token"):
        config_json.pop(key, None)
    path.write_text(json.dumps(config_json, indent=2) + "\n")


def save_bert_char_tokenizer(folder, config) -> None:
    """A BERT-style one-token-per-character tokenizer for a tiny encoder: [PAD] at the config's pad id, [UNK], [CLS],
    [SEP], [MASK] (matched in the text as one token), "[CLS] $A [SEP]" added around every text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    names = ("pad", "unk", "cls", "sep", "mask")
    ids = [config.pad_token_id] + [i for i in range(config.vocab_size) if i != config.pad_token_id][: len(names) - 1]
    special = {f"[{n.upper()}]": i for n, i in zip(names, ids)}
    free = iter(i for i in range(config.vocab_size) if i not in special.values())
    vocab = dict(special)
    for c in ["▁"] + [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]:
        vocab[c] = next(free)
    for i in free:
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", special["[CLS]"]), ("[SEP]", special["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{n}_token": f"[{n.upper()}]" for n in names})
    fast.save_pretrained(folder)
