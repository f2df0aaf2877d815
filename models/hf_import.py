"""A model shape from a Hugging Face config.json, without a hand-written flavor.

config.json's `model_type` picks the registered family whose ModelSpec.hf_model_types holds it, and
that family's `args_from_hf` reads the shape (refusing anything it does not implement). A folder
written by `scripts/convert_hf.py from-hf` without --config holds the config.json it came from and a
`kiln_model.py` that calls `register_folder_flavor` on its own folder, so that its `config.toml`
(job.custom_import = that file, model.flavor = FLAVOR) builds exactly that model.
"""

from pathlib import Path
from typing import Any

from components.checkpoint.hf_folder import load_hf_config
from components.runtime.errors import KilnError
from models import ModelSpec, get_model_spec, registered_specs

FLAVOR = "hf_import"  # the flavor name an imported folder registers its shape under


def supported_model_types() -> dict[str, str]:
    """Every importable Hugging Face model_type → the registered family that reads it. The first
    family registered for a model_type keeps it: a variant registered later (a copy of llama3's spec
    under another name, say) does not take the imports over."""
    families: dict[str, str] = {}
    for spec in registered_specs():
        if spec.args_from_hf is not None:
            for model_type in spec.hf_model_types:
                families.setdefault(model_type, spec.name)
    return families


def args_from_hf_config(config: dict[str, Any]) -> tuple[ModelSpec, Any]:
    """(family, args) of a config.json dict; an unknown model_type lists the supported ones."""
    model_type = config.get("model_type")
    families = supported_model_types()
    if model_type not in families:
        raise KilnError(f"config.json has model_type {model_type!r}, which Kiln cannot import; supported: "
                        f"{', '.join(f'{t} ({n})' for t, n in sorted(families.items()))}")
    spec = get_model_spec(families[model_type])
    return spec, spec.args_from_hf(config)


def args_from_hf_folder(folder: Path) -> tuple[ModelSpec, Any]:
    """(family, args) of the config.json in `folder`; errors name the file."""
    config = load_hf_config(folder)
    try:
        return args_from_hf_config(config)
    except KilnError as e:  # the families' messages say "config.json ...": name the file itself
        message = str(e)
        path = str(Path(folder) / "config.json")
        raise KilnError(path + message.removeprefix("config.json") if message.startswith("config.json")
                        else f"{path}: {message}") from None


def register_folder_flavor(folder: str | Path) -> tuple[ModelSpec, Any]:
    """Read `folder`/config.json and register its shape as flavor FLAVOR of its family (the latest
    folder read in a process wins); returns (family, args)."""
    spec, args = args_from_hf_folder(Path(folder))
    spec.flavors[FLAVOR] = args
    return spec, args
