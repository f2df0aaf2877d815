"""The README's first run, run as the README says, against the output the README shows.

The command is read from the README's first fenced bash line that starts with `torchrun`, and the
shown output from the fenced block after it, so the test follows the README. Every shown line must
still be printed, in the same order, with the same fields; numbers must be equal except those that
depend on the machine (tok/s, TFLOP/s, MFU, memory, durations, the CPU-peak cache and when it was
measured). Losses, grad norms, learning rates, the step count and the layout, batch and data lines
are compared exactly. `...` in the shown output stands for step lines left out.
"""

import re
import shlex
from pathlib import Path

import tomllib

from tests.helpers.runs import REPO, check_ok, run_train

README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)

# Machine-dependent fragments, replaced by a placeholder on both sides before lines are compared.
VOLATILE = [
    (re.compile(r"[\d,]+(\.\d+)? tok/s"), "<n> tok/s"),
    (re.compile(r"\d+(\.\d+)? TFLOP/s"), "<n> TFLOP/s"),
    (re.compile(r"MFU +\d+(\.\d+)?%"), "MFU <n>%"),
    (re.compile(r"\d+(\.\d+)? GiB"), "<n> GiB"),
    (re.compile(r"\bin \d+(\.\d+)? s\b"), "in <n> s"),
    (re.compile(r"\beta \S+"), "eta <duration>"),
    (re.compile(r"\b(\d+h)?(\d+m)?\d+(\.\d+)?s\b"), "<duration>"),
    (re.compile(r"measured by CPU time (now|on \S+),"), "measured by CPU time <when>,"),
    (re.compile(r"cached in [^\s)]+"), "cached in <path>"),
]


def readme_quick_start(text: str) -> tuple[str, str]:
    """The quick-start command line and the output block shown after it."""
    blocks = list(FENCE.finditer(text))
    for i, block in enumerate(blocks):
        if block.group(1) != "bash":
            continue
        for line in block.group(2).splitlines():
            if line.startswith("torchrun ") and " train.py " in f"{line} ":
                assert i + 1 < len(blocks), "README: no output block after the quick-start command"
                return line.split("#")[0].strip(), blocks[i + 1].group(2)
    raise AssertionError("README: no fenced bash line starting with `torchrun ... train.py`")


def parse_command(command: str) -> tuple[int, list[str]]:
    """(processes, train.py's arguments) of `torchrun --nproc-per-node=N train.py ARGS`."""
    words = shlex.split(command)
    script = words.index("train.py")
    launcher, args = words[1:script], words[script + 1:]
    nproc = 1
    while launcher:
        option = launcher.pop(0)
        if option.startswith("--nproc-per-node="):
            nproc = int(option.split("=", 1)[1])
        elif option == "--nproc-per-node":
            nproc = int(launcher.pop(0))
        else:
            raise AssertionError(f"README command: torchrun option {option!r} is not handled by this test")
    return nproc, args


def masked(line: str) -> str:
    """A line with its machine-dependent numbers replaced and its runs of spaces collapsed."""
    for pattern, placeholder in VOLATILE:
        line = pattern.sub(placeholder, line)
    return " ".join(line.split())


def keyed(lines: list[str]) -> list[tuple[tuple, str]]:
    """(key, line) per line: ("step", N) for a step line, else (first word, its occurrence)."""
    out, seen = [], {}
    for line in lines:
        words = line.split()
        step = re.match(r"step +(\d+)/", line)
        if step:
            key = ("step", int(step.group(1)))
        else:
            seen[words[0]] = seen.get(words[0], 0) + 1
            key = (words[0], seen[words[0]])
        out.append((key, line))
    return out


def compare(shown: str, printed: str) -> list[str]:
    """Every way the README's shown output differs from what the run printed; [] when it holds."""
    problems = []
    shown_lines = [line for line in shown.splitlines() if line.strip() and line.strip() != "..."]
    run = dict(keyed([line for line in printed.splitlines() if line.strip()]))
    order = list(run)
    last = -1
    for key, line in keyed(shown_lines):
        if key not in run:
            problems.append(f"the README shows a line the run no longer prints: {line!r}")
            continue
        actual = run[key]
        if key[0] == "step":
            for field in ("loss", "grad", "lr"):
                want = re.search(rf"\b{field} +(\S+)", line)
                got = re.search(rf"\b{field} +(\S+)", actual)
                if want and (not got or got.group(1) != want.group(1)):
                    problems.append(f"step {key[1]}: the README shows {field} {want.group(1)}, "
                                    f"the run printed {got.group(1) if got else 'none'}")
        if masked(line) != masked(actual):
            problems.append(f"{key[0]} line differs:\n  README: {line}\n  run:    {actual}")
        if order.index(key) < last:
            problems.append(f"the README shows {line!r} out of the order the run prints it in")
        last = max(last, order.index(key))
    shown_keys = {key for key, _ in keyed(shown_lines)}
    for key, line in run.items():
        if key[0] != "step" and key not in shown_keys:
            problems.append(f"the run prints a line the README does not show: {line!r}")
    return problems


def default_dump_folder(args: list[str]) -> str:
    """The dump folder the README's run writes to, as the console prints it."""
    config = Path(args[args.index("--config") + 1])
    path = config if config.exists() else REPO / "train_configs" / config.with_suffix(".toml").name
    return str(Path(tomllib.loads(path.read_text())["job"]["dump_folder"]))


def test_readme_first_run_prints_what_the_readme_shows(tmp_path):
    command, shown = readme_quick_start(README.read_text())
    nproc, args = parse_command(command)
    dump = tmp_path / "run"
    proc = run_train([*args, "--job.dump_folder", str(dump)], nproc=nproc, launcher="torchrun",
                     timeout=900)
    check_ok(proc)
    printed = proc.stdout.replace(str(dump), default_dump_folder(args))
    problems = compare(shown, printed)
    assert not problems, "\n".join(problems) + f"\n\nThe run printed:\n{printed}"


# The comparison itself, on the README's own text: quick, no run needed.

def shown_output() -> str:
    return readme_quick_start(README.read_text())[1]


def as_printed(shown: str) -> str:
    """What a run that matches the README exactly would print (the `...` steps left out)."""
    return "\n".join(line for line in shown.splitlines() if line.strip() != "...")


def test_the_readme_output_matches_itself():
    assert compare(shown_output(), as_printed(shown_output())) == []


def test_a_changed_loss_digit_in_the_readme_fails():
    shown = shown_output()
    step = next(line for line in shown.splitlines() if line.startswith("step"))
    loss = re.search(r"loss +(\d+\.\d+)", step).group(1)
    other = loss[:-1] + str((int(loss[-1]) + 1) % 10)
    problems = compare(shown.replace(step, step.replace(loss, other, 1)), as_printed(shown))
    assert any(f"shows loss {other}, the run printed {loss}" in p for p in problems), problems


def test_machine_dependent_numbers_may_differ():
    shown = shown_output()
    printed = re.sub(r"\b\d+ tok/s", "99,999 tok/s", as_printed(shown))
    printed = re.sub(r"MFU +\d+\.\d+%", "MFU 99.99%", printed)
    printed = re.sub(r"\d+\.\d+ GiB", "12.34 GiB", printed)
    printed = re.sub(r"eta \S+", "eta 1h02m", re.sub(r" in \d+m\d+s", " in 12.3s", printed))
    assert printed != as_printed(shown)
    assert compare(shown, printed) == []


def test_a_line_no_longer_printed_or_a_changed_field_fails():
    shown = shown_output()
    printed = as_printed(shown)
    batch = next(line for line in printed.splitlines() if line.startswith("batch"))
    assert any("no longer prints" in p for p in compare(shown, printed.replace(batch + "\n", "")))
    assert compare(shown, printed.replace(batch, batch.replace("16", "32", 1)))
    step = next(line for line in printed.splitlines() if line.startswith("step"))
    assert compare(shown, printed.replace(step, step + "  new 1.0"))
    assert any("does not show" in p for p in compare(shown, printed + "\nwarning something new"))
