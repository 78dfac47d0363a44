import sys

from lungcal.cli import main

sys.exit(main())
