"""The trace engine: a real PyTorch training step under FakeTensorMode, every live storage counted.

Nothing here imports torch at import time: `vramcalc.trace.engine.run_trace` imports it when
called. Modules: `reference_model` (vramcalc's own readable model), `hf_models` (Hugging Face
configs and models from a ModelSpec), `optim` (Lion, the 8-bit AdamW stand-in and the
mixed-precision wrapper), `cuda_rules` (what CUDA does differently from the CPU kernels),
`tracker` (the live-storage counter), `engine` (the step and the report).
"""
