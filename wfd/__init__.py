"""A decoder for looped (recurrent-depth) language models: Huginn and Ouro architectures, a
recurrence-specific KV cache, and the AR, DtV and WaveFront schedules."""

from costmodel.lazy import lazy_exports

# torch loads on first use, not on `import wfd`
__all__ = lazy_exports(__name__, {"load_model": "checkpoint", "generate": "generate",
                                  "decode_batch": "batch", "RunOptions": "options"})
