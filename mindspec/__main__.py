import sys

from mindspec.cli import main  # absolute: MindSpore's compile cache parses the entry script's imports

sys.exit(main())
