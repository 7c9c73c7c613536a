"""Loss curves of training binaries' JSON logs, one line per run.

usage: python3 tools/plot_loss.py OUT.png LABEL=LOG.jsonl [LABEL=LOG.jsonl ...] [--title TEXT]

Training loss is drawn as a moving average over 50 steps (thin), validation loss as points
joined by a thick line of the same colour. Needs matplotlib.
"""
import json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def read(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    steps = [r["step"] for r in rows if "loss" in r]
    loss = [r["loss"] for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    return steps, loss, val


def smooth(xs, k=50):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main(argv):
    title = None
    if "--title" in argv:
        i = argv.index("--title")
        title = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        sys.exit(__doc__)
    fig, ax = plt.subplots(figsize=(8, 5))
    for n, spec in enumerate(argv[1:]):
        label, path = spec.split("=", 1)
        steps, loss, val = read(path)
        colour = f"C{n}"
        ax.plot(steps, smooth(loss), color=colour, lw=0.8, alpha=0.7, label=f"{label} train (50-step mean)")
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "o-", color=colour, lw=2,
                    label=f"{label} validation ({val[-1][1]:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[0], dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
