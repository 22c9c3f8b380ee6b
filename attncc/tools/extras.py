"""Optional dependencies: what needs them, and the extra that installs them."""
from __future__ import annotations

from ..errors import AttnccError


def require_plotting(what: str = "--plot"):
    """matplotlib (and numpy, which it brings) draw --plot; they come with attncc[plot]."""
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        raise AttnccError(f"{what} draws with matplotlib, which is not installed; install it "
                          "with pip install 'attncc[plot]'") from None
