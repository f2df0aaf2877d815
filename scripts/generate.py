"""Sample text from a Kiln checkpoint (saved in any layout), streaming tokens to the terminal.

Usage (from the repository root):
    python scripts/generate.py --config llama_debug \\
        --checkpoint outputs/llama_debug/checkpoint/step-100 --prompt "ROMEO:" \\
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0]

The model shape and tokenizer come from the config; any --section.key after the options
overrides it (e.g. --model.flavor tiny). Without --config, a checkpoint folder holding a
config.toml (one written by `convert_hf.py from-hf` without --config) is its own config.
One process, on the GPU when there is one; the same seed gives the same text.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from components.checkpoint.manager import load_model_weights
from components.config.loading import load_config
from components.data.tokenizer import Tokenizer
from components.generation import generate  # noqa: E402
from components.runtime.errors import KilnError
from components.runtime.hub import resolve_asset
from models import UnknownModelError, build_plain_model  # noqa: E402

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, type=Path, help="a DCP step folder (…/checkpoint/step-N)")
    ap.add_argument("--prompt", required=True, help="text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = always the most likely token")
    ap.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all")
    ap.add_argument("--top-p", type=float, default=0.95, help="…and among the smallest set reaching p")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_known_args(argv)


class Streamer:
    """Prints the text of each new token as soon as it decodes to whole characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return
        print(text[len(self.printed):], end="", flush=True)
        self.printed = text


def main(argv: list[str]) -> int:
    opts, overrides = parse(argv)
    own = opts.checkpoint / "config.toml"
    if not any(a == "--config" or a.startswith("--config=") for a in overrides) and own.is_file():
        overrides = ["--config", str(own), *overrides]
    try:
        cfg = load_config(overrides)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            # Generation predicts the next token only: multi-token prediction modules are not built
            # (nor loaded: a checkpoint load reads the weights the model asks for).
            model, _, args = build_plain_model(cfg.model.name, cfg.model.flavor, cfg.job.custom_import,
                                               device, cfg.config_dir, mtp_depth=0)
        except UnknownModelError as e:
            raise KilnError(str(e)) from None
        load_model_weights(model, opts.checkpoint)
        tokenizer = Tokenizer(resolve_asset(cfg.model.tokenizer_path, ["tokenizer"]))
        prompt = tokenizer.encode(opts.prompt, bos=True)
        shown = []

        def announce(line: str) -> None:
            """The line saying which path generation takes (stderr), then the prompt the text continues:
            the line comes first so that it does not split the streamed text."""
            print(line, file=sys.stderr, flush=True)
            if not shown:
                print(opts.prompt, end="", flush=True)
                shown.append(True)

        generate(model, prompt, opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                 top_p=opts.top_p, seed=opts.seed, eos_id=tokenizer.eos_id, max_seq_len=args.max_seq_len,
                 on_token=Streamer(tokenizer), note=announce)  # generate() notes before its first token
        print()
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
