"""The demo's plots (matplotlib, Agg): `plot_demo` (random-weight model: error per cache position and per generated
token), `plot_smollm` (SmolLM2: KL vs bytes per element and vs position), both on `two_panel_plot`'s 1 x 2 figure.
The reports are the dicts of `jmixedkv_demo.demo.run_demo` / `run_smollm_demo`."""
from __future__ import annotations

__all__ = ["two_panel_plot", "plot_demo", "plot_smollm"]


def two_panel_plot(path: str, figsize, draw) -> None:
    """``draw(left_axes, right_axes)`` on a 1 x 2 matplotlib figure (Agg), grids on, saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=figsize)
    draw(*axes)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_demo(report: dict, path: str) -> None:
    def draw(a, b):
        n = report["cached_len"]
        for m in report["results"][1:]:
            a.plot(range(n), m["kv0_rel_err_per_position"][:n], label=m["label"], lw=1.2)
            b.plot(range(1, len(m["logit_rel_err_per_step"]) + 1), m["logit_rel_err_per_step"], marker=".",
                   label=m["label"])
        a.legend(fontsize=8)
        b.legend(fontsize=8)
        a.axvline(report["settings"]["prompt_len"] - 0.5, color="k", ls=":", lw=0.8)
        a.set(title="layer-0 K/V rows: relative error vs bf16 (retained windows are exact)",
              xlabel="cache position (prompt | generated)", ylabel="relative L2 error")
        b.set(title="teacher-forced logits: relative error vs bf16", xlabel="generated token",
              ylabel="relative L2 error")
    two_panel_plot(path, (13, 4.5), draw)


def plot_smollm(report: dict, path: str) -> None:
    import numpy as np

    def draw(a, b):
        for r in report["results"][1:]:
            a.scatter(r["bytes_per_element"], max(r["kl"], 1e-6), s=30)
            a.annotate(r["label"], (r["bytes_per_element"], max(r["kl"], 1e-6)), fontsize=7, xytext=(3, 3),
                       textcoords="offset points")
            k = np.asarray(r["kl_per_position"])
            w = min(16, len(k))
            b.plot(report["prefix_len"] + np.arange(len(k) - w + 1), np.convolve(k, np.ones(w) / w, "valid"),
                   lw=1.1, label=r["label"])
        a.set(yscale="log", xlabel=f"KV bytes per element at {report['seq_len']} tokens (twin and pages included)",
              ylabel="mean KL(bf16 || cache), nats",
              title=f"{report['model']}: error vs memory ({report['text']} text)")
        b.set(yscale="log", xlabel="token position (decode steps after the exact prefill)",
              ylabel="KL vs bf16 (moving mean of 16)", title="error vs position")
        b.legend(fontsize=7)
    two_panel_plot(path, (13, 4.8), draw)
