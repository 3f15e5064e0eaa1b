import sys

from polar_lab.cli import main

sys.exit(main())
