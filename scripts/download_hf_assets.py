"""Fetch a Hugging Face hub model's tokenizer, config and/or weights into a folder, through the
Hugging Face cache (HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads only the cache, HF_TOKEN for gated repos).

    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --assets tokenizer --out assets/llama3
    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --assets config,weights --out hf/8b

Training can also name a hub id directly (--model.tokenizer_path ID, --checkpoint.initial_load_path ID
--checkpoint.initial_load_in_hf), read from the cache the same way.
"""

import argparse
import sys
from pathlib import Path

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.runtime.errors import KilnError
from components.runtime.hub import ASSETS, asset_patterns, copy_snapshot, snapshot


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="hub repository id, e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument("--assets", default="tokenizer",
                        help=f"comma-separated kinds: {', '.join(ASSETS)} (default: tokenizer)")
    parser.add_argument("--out", required=True, type=Path, help="folder the files are copied into")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    try:
        patterns = asset_patterns([a.strip() for a in args.assets.split(",") if a.strip()])
        files = copy_snapshot(snapshot(args.repo, patterns, args.revision), args.out, patterns)
        if not files:
            raise KilnError(f"hub repository {args.repo!r} has no files for --assets {args.assets}")
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
