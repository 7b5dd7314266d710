import sys

from omnirail.cli import main

sys.exit(main())
