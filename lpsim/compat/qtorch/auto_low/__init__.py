"""QPyTorch's ``qtorch.auto_low``: lower() and sequential_lower()."""

from lpsim.compat.qtorch.auto_low.auto_low import lower, sequential_lower

__all__ = ["lower", "sequential_lower"]
