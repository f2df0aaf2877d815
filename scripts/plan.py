"""Plan a run before it costs anything: the real layout and training step of any world size, built
in this one process on fake tensors (torch's fake process group and FakeTensorMode), measured
per rank — memory by kind against a device, communication per mesh dimension, the pipeline
bubble, a step-time estimate — and every reason the layout cannot run, listed at once.

Usage (from the repository root):
    python scripts/plan.py --config llama3_8b --world-size 64 --parallelism.tensor_parallel_degree 8
    python scripts/plan.py --config llama3_405b --world-size 1024 --device h200 \\
        --parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 16

Every --section.key after the options overrides the config, as for train.py. The plan is for
GPUs (bf16 where the config says auto) unless --device cpu. A plan that does not fit is followed
by the single changes that would (more ranks, larger TP/PP, stronger activation checkpointing,
a smaller batch per rank), each planned too, with its peak (--no-suggestions skips them).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from pathlib import Path

# Run as a file, Python puts scripts/ on the path, not the repository root that holds components/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config.loading import load_config
from components.runtime.errors import KilnError
from planning.devices import CPU_EFFICIENCY, CPU_LINKS  # noqa: E402
from planning.plan import DEVICES, Device, make_plan, suggest_changes  # noqa: E402
from planning.report import format_plan, format_search, plan_json, search_json  # noqa: E402
from planning.search import search  # noqa: E402


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, required=True, help="ranks in the planned job")
    ap.add_argument("--rank", type=int, action="append", dest="ranks",
                    help="plan this rank (repeatable); default: the first rank of the first and of the "
                         "last pipeline stage")
    ap.add_argument("--device", default="h100",
                    help=f"a GPU to plan for ({', '.join(DEVICES)}) or cpu; default h100")
    ap.add_argument("--device-memory", help="memory per device instead of the named one's, e.g. 80GiB")
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device instead of the named one's")
    ap.add_argument("--mfu", type=float,
                    help="the compute efficiency (share of the peak) instead of the device's calibrated one")
    ap.add_argument("--reserve-gib", type=float, default=2.0,
                    help="memory kept free for what is not a tensor (CUDA context, NCCL, fragmentation)")
    ap.add_argument("--no-ac-modes", action="store_true",
                    help="skip the peaks of the other activation-checkpoint modes (faster)")
    ap.add_argument("--no-suggestions", action="store_true",
                    help="when the plan does not fit, skip planning the single changes that might")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--search", action="store_true",
                    help="search the layouts of the world (the config's layout is ignored; its global batch "
                         "and sequence length are kept) and print the fastest that fit")
    ap.add_argument("--top", type=int, default=10,
                    help="--search: how many layouts that fit to find and print (the search plans the peaks "
                         "of the fastest layouts until it has found them)")
    return ap.parse_known_args(argv)


def parse_gib(text: str) -> float:
    """'80GiB', '80GB', '80' → GiB."""
    units = {"gib": 1.0, "gb": 1e9 / 2**30, "tib": 1024.0, "tb": 1e12 / 2**30, "mib": 1 / 1024}
    lower = text.strip().lower()
    for unit, factor in units.items():
        if lower.endswith(unit):
            return float(lower[: -len(unit)]) * factor
    return float(lower)


def choose_device(args: argparse.Namespace) -> tuple[Device, str]:
    """(the device to plan against, the device type the layout is checked for)."""
    if args.device == "cpu":
        device, device_type = Device("CPU", 0.0, 0.0, links=CPU_LINKS, efficiency=CPU_EFFICIENCY), "cpu"
    elif args.device.lower() in DEVICES:
        device, device_type = DEVICES[args.device.lower()], "cuda"
    else:
        raise KilnError(f"--device {args.device!r}: choose one of {', '.join(DEVICES)} or cpu")
    if args.device_memory:
        device = dataclasses.replace(device, name=f"{args.device_memory} device",
                                     memory_gib=parse_gib(args.device_memory))
    if args.peak_tflops:
        device = dataclasses.replace(device, peak_tflops=args.peak_tflops)
    if device.memory_gib <= 0 or device.peak_tflops <= 0:
        raise KilnError("planning for cpu needs --device-memory and --peak-tflops")
    return dataclasses.replace(device, reserve_gib=args.reserve_gib), device_type


def main(argv: list[str]) -> int:
    args, rest = parse(argv)
    warnings.filterwarnings("ignore")  # torch's notes about fake process groups and DTensor on CPU
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        device, device_type = choose_device(args)
        cfg = load_config(rest)
        if args.search:
            if args.top < 1:
                raise KilnError("--top must be 1 or more")
            if args.mfu:
                device = dataclasses.replace(device, efficiency=dataclasses.replace(device.efficiency,
                                                                                    compute=args.mfu))
            result = search(cfg, args.world_size, device, device_type=device_type, top=args.top)
            print(search_json(result) if args.json else format_search(result))
            return 0
        plan = make_plan(cfg, args.world_size, device, device_type=device_type, ranks=args.ranks,
                         mfu=args.mfu, ac_modes=not args.no_ac_modes)
        if not plan.fits and not args.no_suggestions:
            print("the plan does not fit: planning single changes that might ...", file=sys.stderr,
                  flush=True)
            suggest_changes(cfg, args.world_size, plan, device_type=device_type)
    except (KilnError, ValueError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    print(plan_json(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
