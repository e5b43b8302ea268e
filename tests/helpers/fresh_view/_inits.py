"""How often the package's ``__init__`` ran in this process's memory (a forked process counts
its server's run: it inherits that memory)."""

count = 0
