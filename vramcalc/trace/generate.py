"""Fake-tensor trace of Hugging Face generation: prefill, then decode steps, with a static cache.

The referee for `vramcalc serve --engine hf`: the transformers model of the spec is built in
the model dtype under FakeTensorMode; a `StaticCache` of `max_cache_len` positions is filled
by one prefill forward over `batch` prompts of `prompt_len` tokens (logits of the last
position only, `logits_to_keep=1`, as `generate` asks), then `decode_steps` one-token
forwards, each followed by the fp32 upcast and argmax of greedy decoding. The tracker
(vramcalc/trace/tracker.py) counts every live storage at the allocator's 512-byte rounding.
No memory is used and no GPU is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramcalc.model import ModelSpec


@dataclass(frozen=True)
class GenerateTrace:
    weights_bytes: int
    cache_bytes: int  # the static cache's tensors after prefill
    prefill_peak_bytes: int  # everything live at the prefill's peak (weights, cache too)
    decode_peak_bytes: int


def trace_generate(spec: ModelSpec, batch: int, prompt_len: int, max_cache_len: int,
                   decode_steps: int = 2) -> GenerateTrace:
    """Trace prefill + `decode_steps` greedy steps of the spec's transformers model."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramcalc.trace.cuda_rules import cuda_autocast_rules
    from vramcalc.trace.hf_models import _transformers, real_device_behaviour, to_hf_config
    from vramcalc.trace.tracker import MemoryTracker

    tf = _transformers()
    cfg = to_hf_config(spec)
    cfg.use_cache = True
    tracker = MemoryTracker()
    with real_device_behaviour(), cuda_autocast_rules(), FakeTensorMode(), tracker, \
            torch.inference_mode():
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                    dtype=torch.bfloat16)
        model.eval()
        weights = tracker.total
        cache = tf.StaticCache(config=cfg, max_cache_len=max_cache_len)
        ids = torch.zeros(batch, prompt_len, dtype=torch.long)
        tracker.set_phase("forward")
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1,
                    cache_position=torch.arange(prompt_len))
        token = out.logits[:, -1, :].to(torch.float32).argmax(-1)
        del out, ids
        cache_bytes = sum(tracker.blocks[t.untyped_storage()._cdata].nbytes
                          for layer in cache.layers for t in (layer.keys, layer.values))
        tracker.set_phase("decode")
        for step in range(decode_steps):
            out = model(input_ids=token[:, None], cache=cache, use_cache=True,
                        logits_to_keep=1, cache_position=torch.tensor([prompt_len + step]))
            token = out.logits[:, -1, :].to(torch.float32).argmax(-1)
            del out
    peaks = tracker.peaks
    return GenerateTrace(weights_bytes=weights, cache_bytes=cache_bytes,
                         prefill_peak_bytes=peaks[(0, "forward")].total,
                         decode_peak_bytes=peaks[(0, "decode")].total)
