import sys

from sglang_hisparse.cli.main import main

sys.exit(main())
