"""GPU: the tiny Qwen3.5 ``save_pretrained`` checkpoint in megatron-core's local-spec GPTModel (fp32, one GPU,
flash-linear-attention's gated delta-rule kernels) against ``Qwen3_5MoeForCausalLM`` on the CPU (fp32, PyTorch
reference code), through the project's loader (``sftprof.models.megatron_load``).

fla's Triton kernels run their fp32 dot products in TF32 on Hopper, so the log-probs agree to ~1e-3 rather than
the CPU test's 1e-5: the test prints the error and bounds it at 2e-2 nats.
"""

import pytest
import torch
import torch.distributed as dist

from fixtures.qwen3_5 import megatron_logprob_errors, save_tiny_checkpoint
from sftprof.allocation import parse_allocation_mode
from sftprof.config import load_config
from sftprof.launch import free_port
from sftprof.models import megatron_config as mc
from sftprof.models.hf import load_hf_config


@pytest.mark.gpu
def test_save_pretrained_checkpoint_in_megatron_on_gpu_matches_hugging_face(tmp_path):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install -e '.[qwen3_5]')")
    from megatron.core import parallel_state, tensor_parallel

    from sftprof.compat import apply_megatron_compat

    save_tiny_checkpoint(tmp_path)
    loaded = load_hf_config(str(tmp_path))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        apply_megatron_compat()
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        cfg = load_config("tiny_qwen3_5_cpu", ["actor.backend=megatron:d1", "actor.gradient_checkpointing=false",
                                               "actor.megatron.use_precision_aware_optimizer=false",
                                               "actor.megatron.main_grads_dtype=float32"])
        tc = mc.build_transformer_config(loaded, cfg, parse_allocation_mode("megatron:d1"), have_te=False)
        err = megatron_logprob_errors(tc, tmp_path, seq_len=256, device="cuda")
        print(f"megatron (GPU, fp32, fla) vs HF (CPU, fp32): max |log-prob error| {err.max().item():.3e}, "
              f"mean {err.mean().item():.3e} over {err.numel()} tokens")
        assert err.max().item() < 2e-2
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
