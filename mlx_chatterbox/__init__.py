"""mlx-chatterbox: Resemble AI's Chatterbox text-to-speech on Apple's MLX."""

from . import _backend

# Before anything imports mlx.core (see _backend).
_backend.configure()

from .api import TTS, Progress  # noqa: E402
from .convert import convert  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0.dev0"
__all__ = ["TTS", "Progress", "SamplingParams", "convert", "__version__"]
