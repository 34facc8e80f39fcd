"""Install hints for lockstep's optional extras: what an ImportError tells the user to run.

A leaf module (no imports), so that any layer may import it.
"""

from __future__ import annotations

DEEPSPEED_INSTALL_HINT = ("pip install 'torch-lockstep[deepspeed]' with PIP_CONSTRAINT naming a constraints file that "
                          "pins torch==2.13.0 (DeepSpeed builds against the installed torch)")
"""For ``deepspeed_config`` and for reading DeepSpeed checkpoints."""

HUGGINGFACE_INSTALL_HINT = "pip install 'torch-lockstep[huggingface]'"
"""For ``lockstep.models.HuggingFaceModel`` and writing Hugging Face folders from checkpoints."""
