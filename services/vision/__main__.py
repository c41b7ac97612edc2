import sys

from services.vision.server import main

sys.exit(main())
