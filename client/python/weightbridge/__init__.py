"""WeightBridge Python client: workers (trainer / rollout ranks) talking to their node daemon."""

from weightbridge._proto import pb, pb_grpc  # noqa: F401
from weightbridge.client import (ApplyResult, EndUpdateResult, LayoutInfo, LoraConfig, ModelConfig, PublishResult, WeightBridgeError,  # noqa: F401
                                 WorkerClient, offer_vmm_fd)
from weightbridge.layouts import (ExplicitLayout, InferredLayout, Piece, PresetLayout, Quantization,  # noqa: F401
                                  extract_pieces,
                                  index_tensors, infer_layout, infer_layout_torch)
from weightbridge.shm import SharedBuffer  # noqa: F401
from weightbridge.discovery import LayoutDescription, TensorPlace  # noqa: F401

__all__ = ["WorkerClient", "ModelConfig", "LoraConfig", "WeightBridgeError", "PublishResult", "ApplyResult", "EndUpdateResult", "LayoutInfo",
           "ExplicitLayout", "PresetLayout", "Piece", "Quantization", "InferredLayout", "infer_layout", "infer_layout_torch",
           "extract_pieces", "index_tensors", "SharedBuffer", "offer_vmm_fd", "LayoutDescription", "TensorPlace"]
