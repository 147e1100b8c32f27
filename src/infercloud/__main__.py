import sys

from infercloud.cli import main

sys.exit(main())
