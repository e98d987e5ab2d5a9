"""The exported graphs run outside PyTorch: ONNX Runtime (fast; its CPU provider computes fp16 ops in fp32) and onnx's
reference evaluator (slow; numpy in the tensors' own dtype, so fp16 stays fp16 and overflows as it would on an fp16
GPU / NPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..runtime.profiles import DEFAULT, PROFILES, RuntimeProfile


class OnnxDecoder:
    """A decoder graph with the I/O `onnx_decoder.export_program` writes. backend: "ort" (ONNX Runtime, CPU) or "reference"
    (with `profile`, a runtime profile's float16 arithmetic: halfsafe.export.onnx_profile_ops)."""

    def __init__(self, model, backend: str = "ort", profile: RuntimeProfile | None = None) -> None:
        import onnx

        self.backend = backend
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
        self.input_names = [i.name for i in proto.graph.input]
        self.output_names = [o.name for o in proto.graph.output]
        self.layers = sum(n.startswith("past_key_values.") and n.endswith(".key") for n in self.input_names)
        cache_in = next(i for i in proto.graph.input if i.name == "past_key_values.0.key")
        dims = cache_in.type.tensor_type.shape.dim
        self.kv_heads, self.head_dim = dims[1].dim_value, dims[3].dim_value
        self.dtype = onnx.helper.tensor_dtype_to_np_dtype(cache_in.type.tensor_type.elem_type)
        if backend == "ort":
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            data = proto.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
            self._session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        elif backend == "reference":
            from .onnx_profile_ops import profile_evaluator

            self._session = profile_evaluator(proto, profile or PROFILES[DEFAULT])
        else:
            raise ValueError(f"backend must be 'ort' or 'reference', not {backend!r}")

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), self.dtype) for _ in range(2 * self.layers)]

    def step(self, ids: np.ndarray, cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward pass of `ids` [batch, new] after `cache`; returns logits [batch, new, vocab] and the new cache."""
        ids = np.asarray(ids, dtype=np.int64)
        batch, new = ids.shape
        past = cache[0].shape[2]
        feed = {
            "input_ids": ids,
            "attention_mask": np.ones((batch, past + new), np.int64),
            "position_ids": np.broadcast_to(np.arange(past, past + new, dtype=np.int64), (batch, new)).copy(),
        }
        for i in range(self.layers):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = cache[2 * i], cache[2 * i + 1]
        feed = {k: v for k, v in feed.items() if k in self.input_names}
        outs = dict(zip(self.output_names, self._session.run(None, feed)))
        present = [outs[f"present.{i}.{kind}"] for i in range(self.layers) for kind in ("key", "value")]
        return outs["logits"], present

    def logits(self, ids) -> np.ndarray:
        """Logits of a whole sequence in one pass (empty cache), [batch, seq, vocab]."""
        ids = np.asarray(ids, dtype=np.int64)
        return self.step(ids, self.empty_cache(ids.shape[0]))[0]

    def greedy(self, ids, new_tokens: int) -> list[int]:
        """Greedy tokens after `ids` [1, seq] with the KV cache: prefill once, then one token per step."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        logits, cache = self.step(ids, self.empty_cache(1))
        out = []
        for _ in range(new_tokens):
            token = int(np.argmax(logits[0, -1].astype(np.float32)))
            out.append(token)
            logits, cache = self.step(np.array([[token]], np.int64), cache)
        return out


class OnnxSeq2Seq:
    """The two graphs `programs` writes, run by ONNX Runtime (CPU): the encoder once, then the decoder token by token."""

    def __init__(self, folder) -> None:
        import onnxruntime as ort

        from .onnx_seq2seq import DECODER_FILE, ENCODER_FILE

        folder = Path(folder)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.encoder = ort.InferenceSession(str(folder / ENCODER_FILE), opts, providers=["CPUExecutionProvider"])
        self.decoder = ort.InferenceSession(str(folder / DECODER_FILE), opts, providers=["CPUExecutionProvider"])
        self.cache_names = [i.name for i in self.decoder.get_inputs() if i.name.startswith("past_key_values.")]
        shape = next(i.shape for i in self.decoder.get_inputs() if i.name == self.cache_names[0])
        self.heads, self.head_dim = shape[1], shape[3]

    def greedy(self, ids, start: int, new_tokens: int):
        """Greedy decoder tokens (after `start`, the decoder start token) for the encoder input `ids` [1, seq], and
        each step's logits [new_tokens, vocab]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        mask = np.ones_like(ids)
        hidden = self.encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        cache = {n: np.zeros((1, self.heads, 0, self.head_dim), np.float16) for n in self.cache_names}
        names = [o.name for o in self.decoder.get_outputs()]
        token, out, logits = start, [], []
        for _ in range(new_tokens):
            feed = {"input_ids": np.array([[token]], np.int64), "encoder_attention_mask": mask,
                    "encoder_hidden_states": hidden, **cache}
            outs = dict(zip(names, self.decoder.run(None, feed)))
            logits.append(outs["logits"][0, -1])
            token = int(np.argmax(logits[-1]))
            out.append(token)
            cache = {n: outs[n.replace("past_key_values", "present")] for n in self.cache_names}
        return out, np.stack(logits)
