import sys

from lowering.cli import main

sys.exit(main())
