"""The bottom floor's path checks, beside errors.py: what a path a user names is (filetypes.py: a regular file, or a
folder, a device, a FIFO), and where a model folder ends (model_folder.py: every file a checkpoint names resolves
inside it). They import nothing of halfsafe's but its error, so every floor may use them: core's plan reader, the
calibration texts, the engine's shard reader, io's trust boundary."""
