"""The ``trajstore`` command; nothing in the package imports it.

* ``main`` - the parser and the dispatch to each command (``main``, ``run``);
* ``registry`` - the list of commands (``@command``) and the arguments several share;
* one module per group of commands: ``inspect`` (info, show), ``compare`` (diff), ``query`` (sql),
  ``export`` (export), ``serve`` (view), ``data`` (verify, upgrade, import);
* ``support`` - what every command shares (a split folder or step file as ``PATH``, one-line errors and
  ``--debug``, CTRL-C as exit 130, ``-o`` files renamed into place when complete);
* ``console`` - tables and text for a terminal.

May import every layer below; a command's modules are loaded when the command runs, so
``trajstore --help`` starts at once.
"""

from .main import main, run

__all__ = ["main", "run"]
