import sys

from tdiff.cli import main

sys.exit(main())
