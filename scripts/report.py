"""Pictures of one or more runs from their metrics.jsonl: one self-contained HTML file plus PNGs.

Usage (from the repository root):
    python scripts/report.py outputs/llama_debug [outputs/other_run ...] --out report.html

Nothing is re-run: every curve comes from <dump_folder>/metrics.jsonl and the header from
<dump_folder>/config.toml. Several folders overlay their curves, and a table gives each run's
per-step loss difference against the first one (the parity picture). Needs matplotlib
(`pip install -e ".[report]"`).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

PLOTS = [  # (metrics key, title, y-axis label)
    ("loss", "Training loss", "loss (nats/token)"),
    ("lr", "Learning rate", "learning rate"),
    ("grad_norm", "Gradient norm (before clipping)", "global L2 norm"),
    ("tps", "Throughput", "tokens/s per device"),
    ("mfu", "Model FLOPs utilisation", "MFU (%)"),
    ("mem_gib", "Peak memory", "GiB per process"),
]


class ReportError(Exception):
    """Bad input: printed as one line."""


def load_run(folder: Path) -> dict:
    """metrics rows (train and validation) and the resolved config of one dump folder."""
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{folder}: no metrics.jsonl (is it a Kiln dump folder?)")
    rows = []
    for n, line in enumerate(metrics.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ReportError(f"{metrics}:{n}: not JSON ({e.msg})") from None
    train = [r for r in rows if "loss" in r]
    if not train:
        raise ReportError(f"{metrics} holds no training rows (the run logged no step)")
    config_file = folder / "config.toml"
    config = tomllib.loads(config_file.read_text()) if config_file.is_file() else {}
    return {"name": folder.name or str(folder), "folder": folder, "train": train, "rows": rows,
            "val": [r for r in rows if "val_loss" in r], "config": config}


def _figure_png(draw, out: Path) -> str:
    """Run draw(ax) on a fresh figure, save it as out (PNG) and return it base64-encoded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=110)
    draw(ax)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return base64.b64encode(out.read_bytes()).decode()


def plot_metric(runs: list[dict], key: str, title: str, ylabel: str, out: Path) -> str:
    def draw(ax) -> None:  # noqa: ANN001
        for i, run in enumerate(runs):  # dashed and dotted lines keep identical curves visible
            steps = [r["step"] for r in run["train"] if key in r]
            ax.plot(steps, [r[key] for r in run["train"] if key in r], label=run["name"],
                    linewidth=2.2 if i == 0 else 1.4, linestyle=("-", "--", ":", "-.")[i % 4])
            if key == "loss" and run["val"]:
                ax.plot([r["step"] for r in run["val"]], [r["val_loss"] for r in run["val"]], "o--",
                        label=f"{run['name']} (validation)", markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    return _figure_png(draw, out)


def plot_expert_load(run: dict, out: Path) -> str:
    """Heatmap of max/mean expert load per MoE layer over steps."""
    rows = [r for r in run["train"] if r.get("moe_imbalance")]
    layers = sorted(rows[0]["moe_imbalance"], key=lambda k: int(k) if k.isdigit() else 0)

    def draw(ax) -> None:  # noqa: ANN001
        data = [[r["moe_imbalance"].get(layer, float("nan")) for r in rows] for layer in layers]
        image = ax.imshow(data, aspect="auto", cmap="viridis", origin="lower",
                          extent=(rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, -0.5, len(layers) - 0.5))
        ax.set_yticks(range(len(layers)), layers)
        ax.set_title(f"Expert load imbalance — {run['name']}")
        ax.set_xlabel("step")
        ax.set_ylabel("MoE layer")
        ax.figure.colorbar(image, ax=ax, label="max / mean tokens per expert")

    return _figure_png(draw, out)


def plot_source_losses(run: dict, out: Path) -> str:
    """A mixture's training loss of each source over steps (and each source's validation loss)."""
    rows = [r for r in run["train"] if r.get("source_loss")]
    names = list(rows[0]["source_loss"])

    def draw(ax) -> None:  # noqa: ANN001
        for name in names:
            points = [(r["step"], r["source_loss"][name]) for r in rows
                      if r["source_loss"].get(name) is not None]
            line, = ax.plot(*zip(*points, strict=True), label=name)
            val = [(r["step"], r["val_source_loss"][name]) for r in run["val"]
                   if name in r.get("val_source_loss", {})]
            if val:
                ax.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{name} (validation)")
        ax.set_title(f"Loss per source — {run['name']}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()

    return _figure_png(draw, out)


def loss_differences(runs: list[dict]) -> list[tuple[str, int, float, float, int]]:
    """Per run after the first: (name, common steps, max |Δloss|, max relative |Δloss|, at step)."""
    ref = {r["step"]: r["loss"] for r in runs[0]["train"]}
    out = []
    for run in runs[1:]:
        common = [(r["step"], r["loss"]) for r in run["train"] if r["step"] in ref]
        if not common:
            out.append((run["name"], 0, float("nan"), float("nan"), 0))
            continue
        step, loss = max(common, key=lambda sl: abs(sl[1] - ref[sl[0]]))
        rel = max(abs(lo - ref[s]) / max(abs(ref[s]), 1e-12) for s, lo in common)
        out.append((run["name"], len(common), abs(loss - ref[step]), rel, step))
    return out


def model_size(config: dict) -> str:
    """Parameter count of the run's model, built on the meta device from its config (total and,
    for MoE, active per token); '?' for a model this checkout does not know."""
    model = config.get("model", {})
    try:
        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from models import get_model_args, get_model_spec

        if config.get("job", {}).get("custom_import"):
            from components.runtime.custom_import import import_custom

            import_custom(config["job"]["custom_import"])
        spec = get_model_spec(model.get("name", ""))
        args = get_model_args(spec, model.get("flavor", ""))
        with torch.device("meta"):
            total = sum(p.numel() for p in spec.model_cls(args).parameters())
    except Exception:  # an unknown or custom model: the report still draws the curves
        return "?"
    if getattr(args, "moe", None) is None:
        return f"{total / 1e6:,.2f}M parameters"
    from models.moe.model import inactive_expert_params

    active = total - inactive_expert_params(args)
    return f"{total / 1e6:,.2f}M parameters ({active / 1e6:,.2f}M active)"


def wall_time(rows: list[dict]) -> float:
    """The run's wall time: the last `time`, which continues across resumes; a file from before that
    (its clock restarting at each resume) adds up each session's last time instead."""
    total, session = 0.0, 0.0
    for t in (r["time"] for r in rows if "time" in r):
        if t < session:  # the clock restarted: an older file's resumed session
            total += session
        session = t
    return total + session


def header(run: dict) -> list[tuple[str, str]]:
    """What a reader wants to know first about a run."""
    c, last = run["config"], run["train"][-1]
    model, train, par = c.get("model", {}), c.get("training", {}), c.get("parallelism", {})
    degrees = " × ".join(f"{k.replace('_degree', '').replace('data_parallel_', 'dp_')} {v}"
                         for k, v in par.items() if k.endswith("_degree") and v not in (1, -1))
    return [("run", run["name"]), ("model", f"{model.get('name', '?')}/{model.get('flavor', '?')}"),
            ("model size", model_size(c)),
            ("layout", degrees or "one process"),
            ("batch", f"global {train.get('global_batch_size', '?')} × seq {train.get('seq_len', '?')}"),
            ("steps", f"{last['step']} of {train.get('steps', '?')}"),
            ("tokens", f"{last.get('tokens', 0):,}"), ("wall time", f"{wall_time(run['rows']):,.1f} s"),
            ("final loss", f"{last['loss']:.4f}")]


def write_report(runs: list[dict], out: Path) -> list[Path]:
    """The HTML file and one PNG per plot beside it; returns the PNG paths."""
    png_dir = out.with_suffix("")
    png_dir.mkdir(parents=True, exist_ok=True)
    images, pngs = [], []
    for key, title, ylabel in PLOTS:
        if any(key in r for run in runs for r in run["train"]):
            path = png_dir / f"{key}.png"
            images.append((title, plot_metric(runs, key, title, ylabel, path)))
            pngs.append(path)
    for i, run in enumerate(runs):
        if any(r.get("source_loss") for r in run["train"]):
            path = png_dir / f"source_loss_{i}.png"
            images.append((f"Loss per source — {run['name']}", plot_source_losses(run, path)))
            pngs.append(path)
        if any(r.get("moe_imbalance") for r in run["train"]):
            path = png_dir / f"expert_load_{i}.png"
            images.append((f"Expert load — {run['name']}", plot_expert_load(run, path)))
            pngs.append(path)
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Kiln report</title><style>",
             "body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:left}img{max-width:100%}</style></head><body>",
             f"<h1>Kiln report: {e(', '.join(r['name'] for r in runs))}</h1>"]
    for run in runs:
        parts.append("<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in header(run))
                     + "</table>")
    if len(runs) > 1:
        parts.append(f"<h2>Loss difference against {e(runs[0]['name'])}</h2><table><tr><th>run</th>"
                     "<th>common steps</th><th>max |Δ loss|</th><th>max relative</th><th>at step</th></tr>")
        for name, n, diff, rel, step in loss_differences(runs):
            parts.append(f"<tr><td>{e(name)}</td><td>{n}</td><td>{diff:.3e}</td><td>{rel:.3e}</td>"
                         f"<td>{step}</td></tr>")
        parts.append("</table>")
    for title, data in images:
        parts.append(f"<h2>{e(title)}</h2><img alt='{e(title)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    out.write_text("\n".join(parts))
    return pngs


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="dump folders (each with metrics.jsonl)")
    ap.add_argument("--out", type=Path, default=Path("report.html"))
    args = ap.parse_args(argv)
    try:
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            raise ReportError("report.py needs matplotlib: pip install -e \".[report]\"") from None
        runs = [load_run(f) for f in args.folders]
        pngs = write_report(runs, args.out)
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({len(pngs)} plots; PNGs in {args.out.with_suffix('')}/)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
