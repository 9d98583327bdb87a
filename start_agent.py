"""Launch the agents (one MindSpore process per configured port), wait for readiness, supervise.

python start_agent.py [--config config/default.yaml] [--groups 0,1]
"""

import sys

from agent.launcher.start import main

if __name__ == "__main__":
    sys.exit(main())
