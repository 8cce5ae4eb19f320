"""Entry point of the Checkpointer's helper process:
``python -m gds_persist.training._helper_main FD PID`` (a module of its own, so that ``-m`` does
not re-run ``gds_persist.training.helper``, which the package has already imported)."""

import sys
from multiprocessing.connection import Connection

from gds_persist.training.helper import main

if __name__ == "__main__":
    main(Connection(int(sys.argv[1])), int(sys.argv[2]))
