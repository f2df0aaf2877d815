"""Weights & Biases logging (`--metrics.enable_wandb`, the `[wandb]` extra): one W&B run per Kiln
run, written into <dump_folder>/wandb; a resumed run continues the W&B run it started, whose id
is kept in <dump_folder>/wandb_run_id. WANDB_MODE=offline keeps everything local (wandb sync)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.runtime.errors import KilnError

ID_FILE = "wandb_run_id"


@dataclass(frozen=True)
class WandbOptions:
    """The W&B project, run name ('' = the dump folder's name), run id ('' = new, or the resumed
    run's) and the config to record with the run."""

    project: str = "kiln"
    run_name: str = ""
    run_id: str = ""
    config: dict = field(default_factory=dict)


def start_wandb_run(dump_folder: Path, options: WandbOptions, resumed: bool) -> Any:
    """wandb.init for this run: the configured id, else the id a resumed run saved, else a new one
    (saved for the next resume)."""
    try:
        import wandb
    except ImportError as e:
        raise KilnError(f"metrics.enable_wandb needs wandb, which cannot be imported ({e}); "
                        "pip install 'kiln[wandb]' (wandb)") from None
    id_file = Path(dump_folder) / ID_FILE
    run_id = options.run_id
    if not run_id and resumed and id_file.is_file():
        run_id = id_file.read_text().strip()
    run = wandb.init(project=options.project, name=options.run_name or Path(dump_folder).resolve().name,
                     id=run_id or None, resume="allow", dir=str(dump_folder), config=options.config)
    id_file.write_text(run.id + "\n")  # wandb picks a new id when there is none
    return run
