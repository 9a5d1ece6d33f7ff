"""The one place that imports matplotlib, and only when a figure is drawn: the rest of minipar never
needs it. Agg draws to files without a display (CI, a cluster node). It sits in bench, the lower of the
two layers that draw (a benchmark's own `--plot FILE`, and plot/, which may import bench but not the
other way round). Without matplotlib, pyplot() raises NoMatplotlib, which bench/registry.py and
plot/registry.py turn into the one-line error, exit code 2."""

from __future__ import annotations

from pathlib import Path


class NoMatplotlib(RuntimeError):
    """matplotlib is not installed (it comes with the `viz` extra, which `make setup` installs)."""


def pyplot():
    """matplotlib.pyplot on the Agg backend."""
    try:
        import matplotlib
    except ImportError as missing:
        raise NoMatplotlib("matplotlib is not installed: pip install -e '.[viz]'") from missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def listed_colormap(colours):
    """A colormap of exactly these colours, one per integer value (a rank, say)."""
    pyplot()  # NoMatplotlib here, not an ImportError below
    from matplotlib.colors import ListedColormap

    return ListedColormap(colours)


def save(figure, path: Path | str, dpi: int = 100) -> Path | str:
    """Write `figure` to `path` as a PNG and free it."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return path
