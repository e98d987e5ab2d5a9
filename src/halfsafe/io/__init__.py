"""Reading and writing models: loading (folder, GGUF, hub cache, the built-in model), the trust boundary of a model
folder, input checks before the slow part, and the atomic checkpoint writer."""
