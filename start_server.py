"""Start the engine and the HTTP front end; the agents must be started already.

python start_server.py [--config config/default.yaml]
"""

import sys

from server.start import main

if __name__ == "__main__":
    sys.exit(main())
