"""Serving memory (`vramcalc serve`): weights in the engine's quantized layout, the activation
peak of its profiling forward, CUDA-graph and non-torch memory, KV-cache bytes per token
(GQA/MQA, multi-latent attention, sliding-window and local/global layers) and from those the
KV capacity and the concurrent sequences at a context length. Each engine (vLLM, SGLang, HF
generate) is a profile (vramcalc.serve.engines). No torch import.
"""

from vramcalc.serve.estimate import ServeConfig, ServeReport, serve_estimate

__all__ = ["ServeConfig", "ServeReport", "serve_estimate"]
