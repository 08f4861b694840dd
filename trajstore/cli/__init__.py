"""The ``trajstore`` command; nothing in the package imports it.

* ``main`` - the parser and the dispatch to each command (``main``, ``run``);
* ``support`` - what every command shares (a split folder or step file as ``PATH``, one-line errors and
  ``--debug``, CTRL-C as exit 130, ``-o`` files renamed into place when complete);
* ``console`` - tables and text for a terminal.

May import every layer below; a command's modules are loaded when the command runs, so
``trajstore --help`` starts at once.
"""

from .main import main, run

__all__ = ["main", "run"]
