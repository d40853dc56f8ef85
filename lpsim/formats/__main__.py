"""``python -m lpsim.formats NAME_OR_FORMAT... [--plot PATH]``: the format explorer's command (see
lpsim.explore), under the name of the module that defines the formats."""

from lpsim.explore import main

main(prog="python -m lpsim.formats")
