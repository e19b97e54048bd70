import sys

from gemma4.cli.commands import main

sys.exit(main())
