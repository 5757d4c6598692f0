"""A decoder for looped (recurrent-depth) language models: Huginn and Ouro architectures, a
recurrence-specific KV cache, and the AR, DtV and WaveFront schedules."""

__all__ = ["decode_batch", "generate", "load_model"]


def __getattr__(name: str):  # torch loads on first use, not on `import wfd`
    if name == "load_model":
        from .checkpoint import load_model

        return load_model
    if name == "generate":
        from .generate import generate

        return generate
    if name == "decode_batch":
        from .batch import decode_batch

        return decode_batch
    raise AttributeError(name)
