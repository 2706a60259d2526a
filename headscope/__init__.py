"""headscope: measure, classify and chart every attention head of a Hugging Face causal LM.

import headscope
result = headscope.analyze("gpt2", "sentences.txt", out="reports/gpt2")
result.heads            # one row per (layer, head)
result.layer_entropy()  # mean entropy per layer, in nats
"""

from headscope.config import RunConfig
from headscope.errors import HeadscopeError
from headscope.loading import load_model
from headscope.pipeline import AnalysisResult, analyze

__all__ = ["AnalysisResult", "HeadscopeError", "RunConfig", "analyze", "load_model"]
