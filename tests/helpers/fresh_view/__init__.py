"""A program that writes what it sees of its own process (``python -m tests.helpers.fresh_view
run.dir=DIR``), to compare a trial forked by a warm server with a spawned one: how often this
package's ``__init__`` ran in its memory, how it runs as ``__main__``, its CPU threads (torch's
and the BLAS library's), its random states, its hash seed; and a file it writes and never closes
(``held.txt``), which the interpreter flushes at its end."""

from tests.helpers.fresh_view import _inits

_inits.count += 1
