import sys

from offload.cli.commands import main

sys.exit(main())
