"""Why run work in parallel: the same waiting tasks, one after another, then overlapped in threads.

    python scripts/tutorial/motivation.py                        # 10 tasks of 0.5 s each
    python scripts/tutorial/motivation.py --sleep 0.2 --tasks 8

Each task waits (time.sleep) and then returns its own index, so both runs must add up to
0 + 1 + ... + (tasks - 1). Done one at a time the waits add up; handed to a thread pool they overlap,
because a sleeping thread lets go of Python's global interpreter lock (GIL). Pure-Python arithmetic
keeps the GIL, so threads would not speed it up: that, and one accelerator per worker, is why
distributed training runs one process per device instead of threads.
"""

import argparse
import concurrent.futures
import time


def wait_then_return(index: int, seconds: float) -> int:
    """Stand-in for work that mostly waits (disk, network, a device): sleep, then hand back the index."""
    time.sleep(seconds)
    return index


def run_sequential(tasks: int, seconds: float) -> tuple[int, float]:
    """Run every task in turn in this thread; return the sum of their results and the wall time."""
    start = time.perf_counter()
    total = sum(wait_then_return(i, seconds) for i in range(tasks))
    return total, time.perf_counter() - start


def run_threaded(tasks: int, seconds: float) -> tuple[int, float]:
    """Run the tasks on a pool with one thread per task; return the sum and the wall time."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=tasks) as pool:
        total = sum(pool.map(wait_then_return, range(tasks), [seconds] * tasks))
    return total, time.perf_counter() - start


def main() -> None:
    """Time both ways, print the results and times, and check the two results agree."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds each task waits")
    parser.add_argument("--tasks", type=int, default=10, help="how many tasks")
    args = parser.parse_args()
    if args.tasks < 1 or args.sleep < 0:
        parser.error("--tasks must be at least 1 and --sleep not negative")

    print(f"== {args.tasks} tasks, each sleeps {args.sleep} s and returns its index")
    seq_result, seq_time = run_sequential(args.tasks, args.sleep)
    print(f"sequential: result {seq_result}  time {seq_time:.3f} s")
    thr_result, thr_time = run_threaded(args.tasks, args.sleep)
    print(f"threaded:   result {thr_result}  time {thr_time:.3f} s")
    print(f"speed-up: {seq_time / thr_time:.1f}x")

    expected = args.tasks * (args.tasks - 1) // 2
    if not seq_result == thr_result == expected:
        raise SystemExit(f"check failed: results {seq_result}, {thr_result}, expected {expected}")
    print(f"check: both results equal 0 + 1 + ... + {args.tasks - 1} = {expected}")
    print("why: a sleeping thread releases the GIL so the waits overlap; CPU-bound Python holds the GIL "
          "and would not speed up in threads, which is one reason distributed training uses processes.")


if __name__ == "__main__":
    main()
