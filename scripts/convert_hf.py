"""Converts a Kiln DCP checkpoint to a Hugging Face folder, and a Hugging Face folder to a Kiln one.

Usage (from the repository root):
    python scripts/convert_hf.py to-hf --config llama_debug \\
        --checkpoint outputs/llama_debug/checkpoint/step-100 --out hf/llama_debug [--dtype bfloat16]
    python scripts/convert_hf.py from-hf --config llama_debug --hf hf/llama_debug --out seed/step-0
    python train.py --config llama_debug --checkpoint.initial_load_path seed/step-0
    python scripts/convert_hf.py from-hf --hf hf/some_llama --out imported     # no --config
    python scripts/generate.py --checkpoint imported --prompt "Hello"
    python train.py --config imported/config.toml --job.dump_folder outputs/finetune

The model shape comes from the config; any --section.key after the options overrides it
(e.g. --model.flavor tiny). from-hf without --config reads the family and the shape from the
folder's config.json (models/hf_import.py) and writes beside the weights what generate.py and
train.py need: that config.json, the tokenizer files, kiln_model.py and config.toml.
Runs as one process on CPU; the model must fit in memory.
"""

from __future__ import annotations

import argparse
import json
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
from models.hf_import import FLAVOR, register_folder_flavor

# One process, no process group, is what we mean: DCP's warning about it is noise here.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")


def build_model(cfg: JobConfig) -> tuple[nn.Module, Any]:
    """The plain model of the config on CPU, and its flavor's Hugging Face adapter."""
    model, spec, args = build_plain_model(cfg.model.name, cfg.model.flavor, cfg.job.custom_import,
                                          config_dir=cfg.config_dir, mtp_depth=cfg.model.mtp_depth)
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


# Copied from the Hugging Face folder when there: what Kiln's Tokenizer and transformers read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
REGISTER_SOURCE = '''"""Written by scripts/convert_hf.py from-hf: registers the model of the config.json
beside this file as flavor {flavor!r} of its family (the job.custom_import of the config.toml
beside it)."""
from pathlib import Path

from models.hf_import import register_folder_flavor

register_folder_flavor(Path(__file__).resolve().parent)
'''


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a TOML basic string for any path


def from_hf_without_config(hf: Path, out: Path) -> None:
    """HF folder → a self-describing Kiln folder: the model-only DCP checkpoint, plus config.json (the
    shape), the tokenizer files, kiln_model.py (registers the shape as a flavor) and config.toml (a
    run config naming all of it), so that generate.py and train.py need no hand-written flavor."""
    tmp = fresh_folder(out)
    spec, args = register_folder_flavor(hf)  # refuses what the family does not implement, naming it
    if spec.state_dict_adapter is None:
        raise KilnError(f"model {spec.name!r} has no Hugging Face state-dict adapter")
    model, _, _ = build_plain_model(spec.name, FLAVOR)
    adapter = spec.state_dict_adapter(args)
    kiln = kiln_state_from_hf(hf, adapter)
    check_model_matches(model.state_dict(), {f"model.{k}": tuple(v.shape) for k, v in kiln.items()}, hf)
    model.load_state_dict(kiln, strict=True)
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp))
    shutil.copyfile(hf / "config.json", tmp / "config.json")
    copied = [name for name in TOKENIZER_FILES if (hf / name).is_file()]
    for name in copied:
        shutil.copyfile(hf / name, tmp / name)
    (tmp / "kiln_model.py").write_text(REGISTER_SOURCE.format(flavor=FLAVOR))
    final = out.resolve()
    tokenizer = (f"tokenizer_path = {_toml_string(str(final))}\n" if "tokenizer.json" in copied else
                 "# no tokenizer.json in the Hugging Face folder: set tokenizer_path\n")
    (tmp / "config.toml").write_text(
        f"# Written by scripts/convert_hf.py from-hf from {hf}: the imported model, to sample from or\n"
        f"# train on. Its shape is config.json, read by kiln_model.py; paths are absolute (moving\n"
        f"# this folder means editing them).\n"
        f"#   python scripts/generate.py --checkpoint {final} --prompt \"...\"\n"
        f"#   python train.py --config {final / 'config.toml'} --job.dump_folder outputs/<run>\n\n"
        f"[job]\ncustom_import = {_toml_string(str(final / 'kiln_model.py'))}\n\n"
        f"[model]\nname = {_toml_string(spec.name)}\nflavor = {_toml_string(FLAVOR)}\n{tokenizer}\n"
        f"[checkpoint]\ninitial_load_path = {_toml_string(str(final))}\n")
    tmp.rename(out)
    if "tokenizer.json" not in copied:
        print(f"note: {hf} has no tokenizer.json: set model.tokenizer_path in {out / 'config.toml'}")


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
    out_hf.add_argument("--config", required=True, help="Kiln TOML (or a name in train_configs/)")
    in_hf.add_argument("--config", help="Kiln TOML (or a name in train_configs/); without it the family and "
                       "shape come from the folder's config.json")
    for p in (out_hf, in_hf):
        p.add_argument("--out", required=True, help="folder to create")
    opts, overrides = parser.parse_known_args(argv)
    try:
        if opts.config is None:
            if overrides:
                raise KilnError(f"{overrides[0]}: overrides need --config (without it the model comes "
                                f"from the folder's config.json)")
            from_hf_without_config(Path(opts.hf), Path(opts.out))
            print(f"wrote {opts.out}")
            return 0
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
