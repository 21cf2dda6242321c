import sys

from kdlib.cli import main

sys.exit(main())
