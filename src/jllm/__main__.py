import sys
from jllm.cli import main

sys.exit(main())
