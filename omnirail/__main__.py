import sys

from omnirail.entry import main

sys.exit(main())
