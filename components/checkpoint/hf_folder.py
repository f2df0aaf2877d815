"""Hugging Face model folders (config.json, safetensors, tokenizer files): written and read without pickle."""

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

import tokenizers
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from components.runtime.errors import KilnError

INDEX = "model.safetensors.index.json"


class HFAdapter(Protocol):
    """What a model's state-dict adapter offers here (components/ never imports models/)."""

    def from_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def args_from_hf_config(self, config: dict[str, Any]) -> Any: ...


def save_hf_folder(out: Path, hf_state: dict[str, torch.Tensor], config: dict[str, Any],
                   tokenizer_path: Path, dtype: torch.dtype) -> None:
    """Write a folder that transformers' from_pretrained loads: weights in dtype, config, tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    # safetensors stores only contiguous tensors (the permuted q/k rows are already fresh copies).
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
               for k, v in hf_state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.id_to_token(config["bos_token_id"]),
        "eos_token": vocab.id_to_token(config["eos_token_id"]),
        "clean_up_tokenization_spaces": False,  # decode must give back the text Kiln's tokenizer does
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def _weight_files(folder: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors in the folder."""
    if not folder.is_dir():
        raise KilnError(f"Hugging Face folder not found: {folder}")
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise KilnError(f"cannot read {index}: {type(e).__name__}: {e}") from None
        files = [folder / n for n in names]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise KilnError(f"{index} names {missing[0].name}, which is not in the folder")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise KilnError(f"no *.safetensors weights in {folder}")
    return files


def load_hf_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file or a sharded set), by HF name."""
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise KilnError(f"cannot read {path}: {e}") from None
        twice = state.keys() & part.keys()
        if twice:
            raise KilnError(f"tensor {sorted(twice)[0]!r} is stored twice in {folder}")
        state.update(part)
    return state


def load_hf_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise KilnError(f"no config.json in {folder}" if Path(folder).is_dir()
                        else f"Hugging Face folder not found: {folder}")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise KilnError(f"cannot parse {path}: {e}") from None
    if not isinstance(config, dict):
        raise KilnError(f"{path} is not a JSON object")
    return config


def kiln_state_from_hf(folder: Path, adapter: HFAdapter) -> dict[str, torch.Tensor]:
    """A full state dict in Kiln names from an HF folder, after checking its config fits the model."""
    adapter.args_from_hf_config(load_hf_config(folder))
    return adapter.from_hf(load_hf_state(folder))
