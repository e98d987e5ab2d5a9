"""Which ONNX exporter handles a model, decided from its config: the one registry of exporters.

What the model is picks the kind: an encoder-decoder config (`is_encoder_decoder`) is a seq2seq model; a model type
the family data marks as an encoder (`Family.onnx`, halfsafe.families.spec) is one; anything else is taken for a
decoder-only causal LM, which the decoder exporter checks itself (it needs no family data: an unconverted causal LM
of any architecture exports). An encoder-decoder model type the family data does not mark is refused here, in one
line naming how to add it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UnsupportedModelError
from ..families.spec import ONNX_ENCODER, ONNX_SEQ2SEQ
from . import onnx_decoder, onnx_encoder, onnx_seq2seq
from .contract import Exporter
from .onnx_common import EXPORTER

DECODER = "decoder"
EXPORTERS: dict[str, Exporter] = {DECODER: onnx_decoder, ONNX_ENCODER: onnx_encoder, ONNX_SEQ2SEQ: onnx_seq2seq}


def marked_kinds() -> dict[str, str]:
    """model_type -> the exporter kind the family data marks it with (encoders and encoder-decoders only)."""
    from ..families import REGISTRY

    return {model_type: family.onnx.kind for model_type, family in REGISTRY.items()
            if family.onnx is not None and model_type in family.onnx_model_types}


def kind_of(config) -> str:
    """What the model is, for the export: DECODER, ONNX_ENCODER or ONNX_SEQ2SEQ; refuses an encoder-decoder the
    family data does not mark as exportable."""
    model_type = getattr(config, "model_type", "?")
    marked = marked_kinds()
    if getattr(config, "is_encoder_decoder", False):
        if marked.get(model_type) != ONNX_SEQ2SEQ:
            covered = sorted(t for t, kind in marked.items() if kind == ONNX_SEQ2SEQ)
            raise UnsupportedModelError(
                f"{model_type} is an encoder-decoder model the ONNX export ({EXPORTER}) does not cover: it exports "
                f"{', '.join(covered)} (transformers.js's encoder_model + decoder_model_merged layout); to add one, mark its "
                "family `onnx=OnnxExport(ONNX_SEQ2SEQ)` in src/halfsafe/families/ once its graphs are tested"
            )
        return ONNX_SEQ2SEQ
    return ONNX_ENCODER if marked.get(model_type) == ONNX_ENCODER else DECODER


def exporter_for(config) -> Exporter:
    """The exporter that handles `config`'s model, once it has accepted the config (one-line refusal otherwise)."""
    exporter = EXPORTERS[kind_of(config)]
    exporter.check_exportable(config)
    return exporter


def exporter_for_folder(folder: Path) -> Exporter:
    """`exporter_for` the config.json in `folder`."""
    from ..io.loading import read_config

    return exporter_for(read_config(folder))
