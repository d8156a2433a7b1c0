"""specpcg: speculative decoding co-scheduled with piecewise CUDA graphs."""

from specpcg.core import CaptureHiddenMode, ForwardMode, SamplingParams

__all__ = ["Engine", "CaptureHiddenMode", "ForwardMode", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import specpcg` stays light (no model loaders or tokenizers imported).
    if name == "Engine":
        from specpcg.engine import Engine

        return Engine
    raise AttributeError(name)
