"""Exports of a converted checkpoint to runtimes outside PyTorch: fp16 ONNX (`onnx`), llama.cpp GGUF (`gguf`).

Glue over maintained tools: the exporters are transformers' own (torch.onnx's dynamo exporter underneath) and
llama.cpp's converter; halfsafe only picks the inputs, names and file layout, and checks the result.
"""
