"""Model folders the project makes itself: tokenizers and tiny Qwen2-style models.

No model hub is reachable here, so tests and the embedded default use models built by this package,
written as ordinary Hugging Face folders that load with ``AutoModelForCausalLM.from_pretrained``.
"""

from pathlib import Path

from sgl_tts.models.tiny import TinyModelSpec, build_tiny_model, write_byte_level_tokenizer

__all__ = ["DATA", "TinyModelSpec", "build_tiny_model", "default_model_path", "shipped_model",
           "write_byte_level_tokenizer"]


DATA = Path(__file__).parent / "data"


def shipped_model(name: str) -> Path | None:
    """Folder of a model shipped inside the package (``"generator"``, ``"expert"`` or ``"prm"``), if present."""
    path = DATA / name
    return path if (path / "model.safetensors").is_file() else None


def default_model_path() -> Path:
    """The embedded default model folder: the shipped tiny generator for the arithmetic task.

    If the package carries no trained weights (a source tree before ``sgl-tts train-tiny``), an
    untrained seeded tiny Qwen2 is built once into the user cache instead: it exercises the runtime,
    and its text is not meaningful.
    """
    shipped = shipped_model("generator")
    if shipped is not None:
        return shipped
    import os

    root = Path(os.environ.get("SGLANG_TTS_CACHE", Path.home() / ".cache" / "sgl-tts")) / "models"
    path = root / "tiny-untrained-v1"
    if not (path / "model.safetensors").is_file():
        tmp = root / f".tiny-untrained-v1.{os.getpid()}"
        build_tiny_model(tmp, seed=0)
        if not path.exists():
            tmp.replace(path)
    return path
