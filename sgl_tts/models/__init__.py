"""Model folders the project makes itself: tokenizers and tiny Qwen2-style models.

No model hub is reachable here, so tests and the embedded default use models built by this package,
written as ordinary Hugging Face folders that load with ``AutoModelForCausalLM.from_pretrained``.
"""

from pathlib import Path

from sgl_tts.models.tiny import TinyModelSpec, build_tiny_model, write_byte_level_tokenizer

__all__ = ["TinyModelSpec", "build_tiny_model", "default_model_path", "write_byte_level_tokenizer"]


def default_model_path() -> "Path":
    """The embedded default model folder.

    Until the project's trained tiny generator ships (see docs/ARCHITECTURE.md), this is an
    untrained, seeded tiny Qwen2 model, built once into the user cache: it exercises the runtime, and
    its text is not meaningful.
    """
    import os

    root = Path(os.environ.get("SGL_TTS_CACHE", Path.home() / ".cache" / "sgl-tts")) / "models"
    path = root / "tiny-untrained-v1"
    if not (path / "model.safetensors").is_file():
        tmp = root / f".tiny-untrained-v1.{os.getpid()}"
        build_tiny_model(tmp, seed=0)
        tmp.replace(path) if not path.exists() else None
    return path
