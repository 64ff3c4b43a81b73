import sys

from msglab.cli import main

sys.exit(main())
