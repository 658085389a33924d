"""minillm: a small, readable LLM inference engine that the course notebooks build
chapter by chapter."""
from . import configs, kernels, kvmath, roofline
from .configs import ModelConfig
from .generate import generate, generate_no_cache, generate_stream
from .loader import load_model
from .model import Transformer
from .sampling import SamplingParams, StructuredOutputsParams
from .engine import LLM

__all__ = ["configs", "kernels", "kvmath", "roofline", "ModelConfig", "Transformer",
           "SamplingParams", "StructuredOutputsParams", "load_model", "generate",
           "generate_stream", "generate_no_cache", "LLM"]
__version__ = "0.1.0"
