"""Drop-in names of other libraries, on top of lpsim's formats and kernels."""

from lpsim.compat import qtorch

__all__ = ["qtorch"]
