import sys

from proxyd.daemon import main

sys.exit(main())
