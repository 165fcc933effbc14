"""Exports are byte-stable: each drafter architecture, built from a fixed seed on a fixed target config, exports
the very bytes it exported before the architectures became table entries (train/drafters/). A change to what
SGLang receives shows up here first; update the digests only for an intended change of the format."""
import hashlib
import json

import pytest
import torch

from data.config import DrafterConfig
from data.target import load_target_info
from serve.drafter_dir import expected_shapes
from serve.export import write_drafter_dir
from train.drafter import Eagle3Drafter, drafter_config

LLAMA_TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
                "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                "vocab_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "dtype": "bfloat16"}
MLA_TARGET = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 32,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 64,
              "vocab_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "q_lora_rank": 24,
              "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
              "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "rope_theta": 10000.0}, "dtype": "bfloat16"}
CASES = {  # name: (target config, drafter shape)
    "llama": (LLAMA_TARGET, {"arch": "llama"}),
    "llama-narrow": (LLAMA_TARGET, {"arch": "llama", "hidden_size": 16, "num_attention_heads": 2}),
    "mla": (MLA_TARGET, {"arch": "mla"}),
}
# sha256 of (config.json without transformers_version, model.safetensors), with the test command's torch and
# transformers (serve/install_sglang_cpu.sh pins the latter: its LlamaConfig decides config.json's keys)
DIGESTS = {
    "llama": "73bf2894d3f458d9eb8da33295a9b310dd6d997e64d699961de034283eeb49ec",
    "llama-narrow": "6cf3db7f56777b388aa30ed19981a72dfcccbde774a09f50307db7b2e89a6b7f",
    "mla": "1947f7891226c869e6a9eaa7f56555872fd6534dcad9bf19fd8fb71df0ef6156",
}


def export_digest(tmp_path, name: str) -> str:
    target, shape = CASES[name]
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))
    info = load_target_info(tmp_path / "target")
    draft = 24
    d2t = torch.arange(draft, dtype=torch.int64) * 2   # draft id i -> target id 3i
    t2d = torch.zeros(info.vocab_size, dtype=torch.bool)
    t2d[torch.arange(draft) * 3] = True
    config = drafter_config(info, DrafterConfig(**shape), draft, [1, 2, 3])
    torch.manual_seed(0)
    model = Eagle3Drafter(config, d2t, t2d)
    tensors = {k: v for k, v in model.state_dict().items() if k in expected_shapes(config)}
    write_drafter_dir(tmp_path / "out", config, tensors, "card")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    written.pop("transformers_version", None)
    h = hashlib.sha256(json.dumps(written, sort_keys=True).encode())
    h.update((tmp_path / "out" / "model.safetensors").read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_export_bytes_are_unchanged(tmp_path, name):
    assert export_digest(tmp_path, name) == DIGESTS[name]
