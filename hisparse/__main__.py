import sys

from hisparse.cli import main

sys.exit(main())
