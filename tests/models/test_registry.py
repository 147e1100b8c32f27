from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infercloud.engine.model_config import ModelConfig, UnsupportedModelError
from infercloud.models.registry import ModelNotFoundError, resolve_model


def test_resolve_folder_and_unknown_name(tiny_model_dir: Path) -> None:
    name, path = resolve_model(str(tiny_model_dir))
    assert name == tiny_model_dir.name and path == tiny_model_dir.resolve()
    with pytest.raises(ModelNotFoundError):
        resolve_model("no-such-model")


def test_unsupported_architecture_is_refused() -> None:
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]}, {})


@pytest.mark.slow
def test_models_json_lists_the_prepared_default(real_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "infercloud", "models", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    entries = json.loads(out.stdout)
    assert entries == [{"name": "SmolLM2-135M-Instruct", "path": str(real_model_dir)}]
    config = ModelConfig.from_folder(real_model_dir)
    assert (config.vocab_size, config.num_layers, config.hidden_size) == (49152, 30, 576)
    assert (real_model_dir / "tokenizer.json").is_file()
    assert "chat_template" in json.loads((real_model_dir / "tokenizer_config.json").read_text())
