"""Run a QPyTorch script unchanged on lpsim: ``python -m lpsim.compat.qtorch SCRIPT [ARGS...]``
installs lpsim.compat.qtorch as ``qtorch`` and runs SCRIPT as ``__main__`` with ARGS in sys.argv
(SCRIPT's folder first on sys.path, as ``python SCRIPT`` would put it)."""

import os
import runpy
import sys

import lpsim.compat.qtorch


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m lpsim.compat.qtorch SCRIPT [ARGS...]")
    script = sys.argv[1]
    lpsim.compat.qtorch.install()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
