"""Running a model in float16 somewhere: the pure-fp16 loader, the baselines people use instead of a rescale (clamp,
fp32 residual), and runtime profiles (which quantities a runtime computes in float16) with their emulation."""
