"""``python -m trainer`` / ``torchrun --nproc_per_node N -m trainer train -- --logs DIR --out FILE``."""

import sys

from trainer.cli import main

sys.exit(main())
