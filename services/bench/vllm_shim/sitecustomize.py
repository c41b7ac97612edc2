"""Loaded by the vLLM peer server only (its PYTHONPATH): vLLM's LLaVA path without torchvision.

vLLM imports transformers' torchvision-based Pixtral image processor module for one helper
(`_num_image_tokens`). Without torchvision that import fails and vLLM cannot inspect
LlavaForConditionalGeneration. transformers ships a PIL twin of the module with the same
helper; point the import there, only when torchvision is absent.
"""

import importlib.util
import sys

if importlib.util.find_spec("torchvision") is None:
    import transformers.models.pixtral.image_processing_pil_pixtral as _pil

    sys.modules["transformers.models.pixtral.image_processing_pixtral"] = _pil
