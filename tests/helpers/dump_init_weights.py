"""Build a Trainer (no steps) and save its gathered full state dict: the init-invariance probe.

    torchrun ... tests/helpers/dump_init_weights.py OUT.pt --config ... [overrides]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

from components.config.loading import load_config
from components.runtime.distributed import exit_cleanly, init_distributed
from train import Trainer  # noqa: E402


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = load_config(argv)
    info = init_distributed(cfg.comm.timeout_seconds)
    trainer = Trainer(cfg, info)
    full = get_model_state_dict(
        trainer.model.parts[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if info.is_main:
        torch.save({k: v.clone() for k, v in full.items()}, out)
    exit_cleanly(0, trainer.dims.release)


if __name__ == "__main__":
    main()
