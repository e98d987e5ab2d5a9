"""How data flows through a model too big to hold: its weights stay in the checkpoint's shards and each unit
(a block, an embedding, a head) is loaded, run and freed in turn (`streamed`, the model's `core.weights.Weights`);
the converted checkpoint is written tensor by tensor (`write`); `shards` reads the input, `device` picks where it
computes. Modules outside the engine use what it offers (`precision.in_dtype`, `pipeline.in_step`, `write.save_fp16`)
and need not ask whether a model is streamed."""
