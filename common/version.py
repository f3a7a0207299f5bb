"""The package version, as installed (or the source tree's when running uninstalled)."""

from importlib import metadata

try:
    __version__ = metadata.version("mlx-headroom")
except metadata.PackageNotFoundError:  # running from a source checkout
    __version__ = "0.0.0+src"
