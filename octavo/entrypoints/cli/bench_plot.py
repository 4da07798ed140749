"""`octavo bench throughput --concurrency ... --plot FILE.png`: total tokens/s against
concurrency, one line per backend, from the sweep in a bench report."""
from __future__ import annotations


def plot_sweep(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'octavo[bench]'") from None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float]]] = {}
    for point in report["sweep"]:
        for row in point["results"]:
            xs, ys = series.setdefault(row["backend"], ([], []))
            xs.append(point["concurrency"])
            ys.append(row["total_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for backend, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xticks([p["concurrency"] for p in report["sweep"]])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (running requests / sequences / batch size)")
    ax.set_ylabel("total tokens/s (prompt + generated)")
    ax.set_title(f"{report['num_prompts']} requests, {report['dataset']} dataset, "
                 f"{report['prompt_tokens']} prompt + {report['output_tokens']} generated tokens",
                 fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
