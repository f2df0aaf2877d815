"""A fault-tolerant job on one machine: a torchft lighthouse and N replica groups, each its own
torchrun job (scripts/launch.py) of train.py, their console lines prefixed with the group's number.

    python scripts/ft_launch.py --groups 2 --nproc-per-group 2 -- --config llama_debug.toml

Everything after `--` goes to every group's train.py, followed by the [fault_tolerance] options that
make it group i of N. A group that fails is started again (up to --restarts times): it heals from
the live groups and rejoins. On a cluster, run the lighthouse once and one group per set of nodes
(docs/fault_tolerance.md has the SLURM recipe).
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from components.fault_tolerance.lighthouse import lighthouse  # noqa: E402


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options, and train.py's arguments (after `--`)."""
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2, help="replica groups (fault_tolerance.group_size)")
    p.add_argument("--nproc-per-group", type=int, default=1, help="processes in each group")
    p.add_argument("--min-replicas", type=int, default=1, help="groups a quorum (and a commit) needs")
    p.add_argument("--port", type=int, default=29510, help="the lighthouse's port (0: any free port)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                   help="a group silent this long is dropped from the quorum")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="how long a quorum waits for live groups that have not asked for it yet")
    p.add_argument("--restarts", type=int, default=3, help="times a failed group is started again")
    return p.parse_args(ours), train_args


def group_command(args: argparse.Namespace, train_args: list[str], group: int, lighthouse: str) -> list[str]:
    return [sys.executable, str(REPO / "scripts" / "launch.py"), "--standalone",
            f"--nproc-per-node={args.nproc_per_group}", str(REPO / "train.py"), *train_args,
            "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group),
            "--fault_tolerance.group_size", str(args.groups),
            "--fault_tolerance.min_replicas", str(args.min_replicas),
            "--fault_tolerance.lighthouse", lighthouse]


def start_group(command: list[str], group: int) -> subprocess.Popen:
    """One group's torchrun job, its output copied to ours line by line behind `[group i]`."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def copy() -> None:
        for line in proc.stdout:
            print(f"[group {group}] {line}", end="", flush=True)

    threading.Thread(target=copy, daemon=True).start()
    return proc


def main(argv: list[str]) -> int:
    args, train_args = parse(argv)
    if not 1 <= args.min_replicas <= args.groups:
        print(f"ft_launch: --min-replicas must be between 1 and --groups ({args.groups})", file=sys.stderr)
        return 2
    with lighthouse(args.min_replicas, port=args.port, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                    join_timeout_ms=args.join_timeout_ms) as address:
        return run_groups(args, train_args, address)


def run_groups(args: argparse.Namespace, train_args: list[str], address: str) -> int:
    """Start the groups, start again those that fail (up to --restarts), wait for all."""
    print(f"ft_launch: lighthouse at {address}; {args.groups} group(s) of {args.nproc_per_group} process(es)",
          flush=True)
    commands = [group_command(args, train_args, g, address) for g in range(args.groups)]
    groups = {g: start_group(commands[g], g) for g in range(args.groups)}
    restarts = {g: 0 for g in groups}
    signal.signal(signal.SIGTERM, lambda *_: [os.killpg(p.pid, signal.SIGTERM) for p in groups.values()])
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(groups):
            for g, proc in groups.items():
                code = proc.poll()
                if code is None or g in codes:
                    continue
                if code not in (0, 2) and restarts[g] < args.restarts:  # 2: a config error, said already
                    restarts[g] += 1
                    print(f"ft_launch: group {g} exited with {code}; starting it again "
                          f"({restarts[g]}/{args.restarts})", flush=True)
                    groups[g] = start_group(commands[g], g)
                else:
                    codes[g] = code
            time.sleep(0.2)
    except KeyboardInterrupt:
        for proc in groups.values():
            os.killpg(proc.pid, signal.SIGTERM)
        return 130
    print(f"ft_launch: groups ended with {', '.join(f'{g}: {c}' for g, c in sorted(codes.items()))}")
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
