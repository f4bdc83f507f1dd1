#!/usr/bin/env python3
"""Plots loss against step for one or more ucp-train runs (their RUN/log.jsonl), marking where a
run resumed and at which layout and process count. Writes a PNG (or SVG, by the extension).

    tools/plot_loss.py OUT.png RUN[=LABEL] [RUN[=LABEL] ...] [--title T]

A run's log keeps the lines up to the checkpoint it resumed from, then a {"event": "resume"} line
(docs/train.md), so one log holds the whole curve of an elastic run. Uses Debian's
python3-matplotlib (tools/setup.sh installs it), with the Agg backend (no display needed).
"""
import argparse
import json
import os
import sys


def read_log(run):
    path = os.path.join(run, "log.jsonl") if os.path.isdir(run) else run
    steps, losses, val_steps, vals, events = [], [], [], [], []
    with open(path) as f:
        for line in f:
            j = json.loads(line)
            if j.get("event") in ("start", "resume"):
                events.append(j)
            elif "loss" in j:
                steps.append(j["step"])
                losses.append(j["loss"])
                if "val_loss" in j:
                    val_steps.append(j["step"])
                    vals.append(j["val_loss"])
    return steps, losses, val_steps, vals, events


def layout_label(event):
    layout = event.get("layout", "")
    short = ",".join(kv for kv in layout.split(",")
                     if kv.split("=")[0] in ("dp", "zero") or kv.split("=")[1] != "1")
    return "%s (%d proc)" % (short, event.get("processes", 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="RUN folder or log.jsonl, optionally =LABEL")
    ap.add_argument("--title", default="ucp-train: loss per step")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    styles = ["-", "--", ":", "-."]
    for i, spec in enumerate(args.runs):
        run, _, label = spec.partition("=")
        label = label or os.path.basename(os.path.normpath(run))
        steps, losses, val_steps, vals, events = read_log(run)
        if not steps:
            print("plot_loss: %s has no step lines" % run, file=sys.stderr)
            return 1
        line, = ax.plot(steps, losses, styles[i % len(styles)], lw=1.2, label=label)
        if vals:
            ax.plot(val_steps, vals, "o", ms=4, color=line.get_color(),
                    label=label + " (held-out)")
        for e in events:
            s = e.get("step", 0)
            ax.axvline(s, color=line.get_color(), lw=0.8, ls=":", alpha=0.8)
            what = "start" if e["event"] == "start" else "resume"
            ax.annotate("%s at %s" % (what, layout_label(e)), xy=(s, 1), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print("plot_loss: wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
