"""What the launcher's fork server imports before it forks any rank (see :func:`labkit.processes.fork_server_context`).

Importing this module is the server's whole set-up, and nothing else should import it:

- torch and ``torch.distributed``, once, so that every rank forked from the server starts with them;
- the server dies with the process that started it (a notebook's kernel). Each rank already dies
  with *its* parent, which is now the server, so a kernel killed hard still takes every rank with it.
  Multiprocessing's own signal cannot do this: the server exits when no process holds its
  "alive" pipe, and every forked rank holds a copy of it.
"""

import torch  # noqa: F401
import torch.distributed  # noqa: F401

from labkit import launcher  # noqa: F401 - what every rank runs first
from labkit.processes import die_with_parent

die_with_parent()
