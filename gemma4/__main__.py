import sys

from gemma4.cli import main

sys.exit(main())
