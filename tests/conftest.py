"""Session-wide test settings."""

from __future__ import annotations

import torch

# Same as LLMEngine on CPU: flush float32 denormals before torch starts its thread pool
# (threads inherit the flag), so CPU forwards in tests run at full speed.
torch.set_flush_denormal(True)
