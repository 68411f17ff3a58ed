"""Trainer hooks and engine extensions built on layout discovery (docs/integration.md).

  megatron.MegatronTrainerHook   Megatron-Core trainer rank (preset "megatron")
  fsdp2.FSDP2TrainerHook         torch FSDP2 (fully_shard) trainer rank (preset "fsdp")
  deepspeed.DeepSpeedZero3TrainerHook   DeepSpeed ZeRO-3 trainer rank (preset "fsdp_flat": ZeRO-3's
                                 own flat partitions, each parameter's ds_tensor)
  vllm.WeightBridgeWorkerExtension / vllm.VllmRollout   vLLM worker (preset "vllm")
  vllm_lora.WeightBridgeLoraWorkerExtension / vllm_lora.VllmLoraRollout   vLLM LoRA adapter slot
                                 (preset "vllm_lora": a LoRA-adapter model's versions into the
                                 adapter's slot of vLLM's stacked LoRA weights)
  sglang.SglangRollout           SGLang model runner (preset "sglang")

Each sizes its buffer from the daemon's layout description and moves tensors by their framework
names; none computes an offset. torch is imported only when torch tensors are handed in, so the
modules import (and are tested in CI with numpy arrays) without torch.
"""
