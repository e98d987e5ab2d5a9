"""What a serving engine needs to know of a folder halfsafe wrote, loaded inside the engine's own processes.

Standard library only, and apart from the `halfsafe` package (whose import pulls in torch, transformers and the
converter): `fingerprint` checks that a folder's weights are the ones its halfsafe.json describes, `vllm` is the vLLM
plugin (entry point `vllm.general_plugins`, declared in pyproject.toml) that lets vLLM run such a folder in float16.
"""
