"""Converts a Kiln DCP checkpoint to a Hugging Face folder, and a Hugging Face folder to a Kiln one.

Usage (from the repository root):
    python scripts/convert_hf.py to-hf --config llama_debug \\
        --checkpoint outputs/llama_debug/checkpoint/step-100 --out hf/llama_debug [--dtype bfloat16]
    python scripts/convert_hf.py from-hf --config llama_debug --hf hf/llama_debug --out seed/step-0
    python train.py --config llama_debug --checkpoint.initial_load_path seed/step-0

The model shape comes from the config; any --section.key after the options overrides it
(e.g. --model.flavor tiny). Runs as one process on CPU; the model must fit in memory.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

from components.checkpoint.hf_folder import kiln_state_from_hf, save_hf_folder
from components.checkpoint.manager import EXPORT_DTYPES, check_model_matches, load_model_weights
from components.checkpoint.states import ModelState
from components.config.loading import load_config
from components.config.sections import JobConfig
from components.data.tokenizer import Tokenizer
from components.runtime.errors import KilnError
from components.runtime.hub import resolve_asset
from models import UnknownModelError, build_plain_model  # noqa: E402

# One process, no process group, is what we mean: DCP's warning about it is noise here.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")


def build_model(cfg: JobConfig) -> tuple[nn.Module, Any]:
    """The plain model of the config on CPU, and its flavor's Hugging Face adapter."""
    model, spec, args = build_plain_model(cfg.model.name, cfg.model.flavor, cfg.job.custom_import,
                                          config_dir=cfg.config_dir)
    if spec.state_dict_adapter is None:
        raise KilnError(f"model {spec.name!r} has no Hugging Face state-dict adapter")
    return model, spec.state_dict_adapter(args)


def fresh_folder(out: Path) -> Path:
    """A sibling out.tmp to write into and rename (which replaces an empty out), refusing a non-empty out."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KilnError(f"--out {out} already exists and is not empty; choose a new folder")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # the remains of an interrupted conversion
    return tmp


def to_hf(cfg: JobConfig, checkpoint: Path, out: Path, dtype: torch.dtype) -> None:
    """DCP step folder → HF folder: load the model part, rename, re-permute, write safetensors."""
    if not (checkpoint / ".metadata").is_file():
        raise KilnError(f"{checkpoint} is not a complete DCP checkpoint (no .metadata)")
    tmp = fresh_folder(out)
    tokenizer = Tokenizer(resolve_asset(cfg.model.tokenizer_path, ["tokenizer"]))
    model, adapter = build_model(cfg)
    load_model_weights(model, checkpoint)
    save_hf_folder(tmp, adapter.to_hf(model.state_dict()),
                   adapter.hf_config(tokenizer.bos_id, tokenizer.eos_id), tokenizer.path, dtype)
    tmp.rename(out)


def from_hf(cfg: JobConfig, hf: Path, out: Path) -> None:
    """HF folder → model-only DCP step folder that train.py resumes from or starts from."""
    tmp = fresh_folder(out)
    model, adapter = build_model(cfg)
    kiln = kiln_state_from_hf(hf, adapter)
    check_model_matches(model.state_dict(), {f"model.{k}": tuple(v.shape) for k, v in kiln.items()}, hf)
    model.load_state_dict(kiln, strict=True)
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp))
    tmp.rename(out)  # published only once complete, like the trainer's own checkpoints


def main(argv: list[str]) -> int:
    """Parse, convert, and turn bad input into one line on stderr with exit code 2."""
    parser = argparse.ArgumentParser(prog="convert_hf", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    # No abbreviations: every unknown --section.key must reach the config parser whole.
    out_hf = sub.add_parser("to-hf", help="Kiln DCP step folder → Hugging Face folder", allow_abbrev=False)
    out_hf.add_argument("--checkpoint", required=True, help="a step-N folder")
    out_hf.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES))
    in_hf = sub.add_parser("from-hf", help="Hugging Face folder → Kiln model-only DCP step folder",
                           allow_abbrev=False)
    in_hf.add_argument("--hf", required=True, help="folder with config.json and *.safetensors")
    for p in (out_hf, in_hf):
        p.add_argument("--config", required=True, help="Kiln TOML (or a name in train_configs/)")
        p.add_argument("--out", required=True, help="folder to create")
    opts, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(["--config", opts.config, *overrides])
        if opts.command == "to-hf":
            to_hf(cfg, Path(opts.checkpoint), Path(opts.out), EXPORT_DTYPES[opts.dtype])
        else:
            from_hf(cfg, Path(opts.hf), Path(opts.out))
    except (KilnError, UnknownModelError, OSError) as e:
        print(f"convert_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
