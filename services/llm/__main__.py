import sys

from services.llm.server import main

sys.exit(main())
