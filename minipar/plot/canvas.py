"""The one place that imports matplotlib, and only when a figure is drawn: the rest of minipar never
needs it. Agg draws to files without a display (CI, a cluster node)."""

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


def save(figure, path: Path, dpi: int = 100) -> Path:
    """Write `figure` to `path` as a PNG and free it."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return path
