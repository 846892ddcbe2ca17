"""``python -m trainer`` / ``torchrun --nproc_per_node N -m trainer train -- --logs DIR --out FILE``."""

import os

from trainer.cli import process_main
from trainer.distributed import leave

# torchrun sets WORLD_SIZE; a rank leaves its process group before the interpreter's teardown (see ``leave``).
leave(process_main(), joined=os.environ.get("WORLD_SIZE", "1") != "1")
