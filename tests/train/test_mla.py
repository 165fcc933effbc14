"""The MLA drafter (`drafter.arch: mla`): its attention against transformers' DeepSeek-V3 attention, its
export against SGLang's `Eagle3DeepseekV2ForCausalLM` loader."""
import json

import pytest
import torch

from data.config import DrafterConfig
from data.target import load_target_info
from tests.extract.test_extract import build_deepseek
from train.drafter import Eagle3Drafter, attend, drafter_config
from train.drafters import arch_of
from train.drafters.mla import FIELDS as MLA_FIELDS


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}  # Kimi-K2.5's kind


@pytest.fixture(scope="module", params=["default", "yarn"])
def deepseek_target(request, make_tokenizer, tmp_path_factory):
    """The tiny DeepseekV3 target, with plain RoPE and with DeepSeek's YaRN."""
    out = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    build_deepseek(out, make_tokenizer("llama3"))
    if request.param == "yarn":
        config = json.loads((out / "config.json").read_text())
        config["rope_parameters"] = YARN
        (out / "config.json").write_text(json.dumps(config))
    return out


def drafter_of(target, arch: str = "mla", **shape) -> Eagle3Drafter:
    """A drafter of the target (the MLA one unless `arch` names another), draft vocab 16, layer ids [1, 2, 3]."""
    info = load_target_info(target)
    config = drafter_config(info, DrafterConfig(arch=arch, **shape), 16, [1, 2, 3])
    vocab = info.vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:16] = True
    torch.manual_seed(0)
    return Eagle3Drafter(config, torch.zeros(16, dtype=torch.int64), t2d)


def export_and_check_with_sglang(drafter: Eagle3Drafter, out,
                                 architecture: str = "Eagle3DeepseekV2ForCausalLM") -> None:
    """Export the drafter (without the target's embedding) and load it with SGLang's own class on the CPU."""
    from serve.export import write_drafter_dir
    from serve.sglang_check import check_in_subprocess
    tensors = {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    write_drafter_dir(out, drafter.config, tensors, "test")
    report = check_in_subprocess(out)[0]
    assert report["architecture"] == architecture and report["ok"], report


def test_mla_dims_come_from_an_mla_target_and_the_config_wins(deepseek_target):
    config = drafter_of(deepseek_target).config
    assert arch_of(config).name == "mla" and config.architectures == ["Eagle3DeepseekV2ForCausalLM"]
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (16, 16, 8, 8, 8)  # the tiny DeepseekV3 target's
    assert drafter_of(deepseek_target, kv_lora_rank=32).config.kv_lora_rank == 32


def test_mla_attention_matches_transformers_deepseek_v3(deepseek_target):
    """Our MLA over the 2H input equals transformers' DeepseekV3Attention built for a 2H-wide model (same
    weights; its o_proj's first H rows are ours), causal, interleaved RoPE, at arbitrary positions."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    drafter = drafter_of(deepseek_target)
    ours, c = drafter.midlayer.self_attn, drafter.config
    H = c.hidden_size
    ref_cfg = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=c.num_attention_heads,
                               num_key_value_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                               kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                               qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope_interleave=True,
                               rms_norm_eps=c.rms_norm_eps, attention_bias=False, max_position_embeddings=512,
                               rope_parameters=c.rope_parameters)
    ref_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(ref_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
            getattr(ref, name).weight.copy_(getattr(ours, name).weight)
        ref.o_proj.weight.zero_()
        ref.o_proj.weight[:H] = ours.o_proj.weight
    B, T = 2, 9
    x = torch.randn(B, T, 2 * H)
    positions = torch.arange(5, 5 + T)[None].expand(B, T)
    cos, sin = drafter.rotary_emb(x, positions)
    ref_cos, ref_sin = DeepseekV3RotaryEmbedding(ref_cfg)(x, positions)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        q, k, v = ours.qkv(x, cos, sin)
        got = ours.o_proj(attend(q, k, v, [], None, ours.scale, "blockwise").transpose(1, 2).flatten(2))
        want = ref(x, position_embeddings=(ref_cos, ref_sin), attention_mask=causal)[0][..., :H]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("sglang"),
                    reason="not run: SGLang's loader check needs sglang (sh serve/install_sglang_cpu.sh)")
def test_mla_export_loads_through_sglangs_own_mla_drafter_class(deepseek_target, tmp_path):
    if "yarn" not in deepseek_target.name:
        pytest.skip("not run: SGLang builds MLA RoPE on CPU only for DeepSeek YaRN (get_rope_cpu); the YaRN case runs")
    from serve.drafter_dir import read_config, read_tensors, validate
    export_and_check_with_sglang(drafter_of(deepseek_target), tmp_path / "mla")
    validate(read_config(tmp_path / "mla"), read_tensors(tmp_path / "mla"), "mla")  # the import path reads it back


@pytest.mark.skipif(not __import__("importlib").util.find_spec("sglang"),
                    reason="not run: SGLang's loader check needs sglang (sh serve/install_sglang_cpu.sh)")
def test_a_llama_drafter_of_a_deepseek_target_exports_for_sglangs_llama_class(tmp_path):
    """The other drafter a DeepseekV3 target can take: Llama attention at the target's width, the target's layer
    ids, SGLang's `LlamaForCausalLMEagle3` building it from every tensor."""
    from launch.demo_target import SGLANG_MLA_DIMS, build_tiny_deepseek
    build_tiny_deepseek(tmp_path / "target", vocab_size=64, rope_parameters=YARN, **SGLANG_MLA_DIMS)
    drafter = drafter_of(tmp_path / "target", arch="llama")
    assert arch_of(drafter.config).name == "llama"
    assert drafter.config.hidden_size == load_target_info(tmp_path / "target").hidden_size
    export_and_check_with_sglang(drafter, tmp_path / "llama", "LlamaForCausalLMEagle3")
    exported = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_the_demo_targets_servable_mla_widths_reach_the_drafter_and_sglangs_loader(tmp_path):
    """The demo's DeepseekV3 target has the latent widths SGLang's MLA kernels serve (RESULTS.md: narrower ones
    crashed its server); the MLA drafter takes them and its export loads through SGLang's class (YaRN RoPE: the
    kind SGLang builds on a CPU)."""
    from launch.demo_target import SGLANG_MLA_DIMS, build_tiny_deepseek
    build_tiny_deepseek(tmp_path / "target", vocab_size=64, rope_parameters=YARN, **SGLANG_MLA_DIMS)
    drafter = drafter_of(tmp_path / "target")
    assert {k: getattr(drafter.config, k) for k in MLA_FIELDS} == {k: SGLANG_MLA_DIMS[k] for k in MLA_FIELDS}
    assert drafter.config.kv_lora_rank + drafter.config.qk_rope_head_dim == 576  # what SGLang's decode kernel splits
    export_and_check_with_sglang(drafter, tmp_path / "mla")


@pytest.mark.slow
def test_the_mla_drafter_end_to_end_on_a_trained_tiny_deepseek_target(tmp_path):
    """A tiny DeepseekV3 target trained on the demo corpus (narrow MLA widths: nothing here serves it through
    SGLang) → regenerate → data → extract (2 ranks) → train (ZeRO-2, 2 ranks, the MLA drafter) → export →
    reference decoder: lossless, and well above the same drafter untrained. (The Llama drafter's run is the same
    stages with another drafter module: the demo covers it end to end; on a DeepseekV3 target its export is
    checked above, and the target's layer ids in tests/data/test_sglang_layer_ids.py.)"""
    from launch.demo_target import build_demo_assets
    from tests.train_runs import demo_config, run_pipeline
    build_demo_assets(tmp_path / "assets", conversations=200, train_steps=300, arch="deepseek_v3",
                      servable_mla=False)
    config = demo_config("demo-deepseek.yaml", tmp_path / "assets", tmp_path / "run")
    config["train"] |= {"drafter": {"arch": "mla"}}
    out = run_pipeline(config, path=tmp_path / "run.yaml")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["stage_seconds"]) == {"regenerate", "data", "extract", "train", "export", "evaluate"}, out
    drafter = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert drafter["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert report["lossless"] is True
    # held-out prompts unseen in training (data/split.py): measured 1.67 (1.72 for the Llama drafter) against 1.06
    # untrained on CPU; before the content split, when most held-out prompts also sat in training data, +0.8 and more
    assert report["accept_length"] > report["accept_length_untrained"] + 0.45, report
    assert report["heldout"]["heldout_overlap_with_training"] == 0


KIMI_TEXT = {  # Kimi-K2.5's language model (DeepseekV3 architecture), as its config.json's text_config names it
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "first_k_dense_replace": 1, "n_routed_experts": 384,
    "num_experts_per_tok": 8, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


def test_real_size_kimi_k25_config_gives_the_published_mla_drafter_shape(tmp_path):
    """No weights: the wrapper config (text_config) alone decides layers, default aux ids and the MLA dims."""
    from serve.drafter_dir import expected_shapes, sglang_config
    from train.drafters.mla import softmax_scale
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                      "model_type": "kimi_k25", "text_config": KIMI_TEXT}))
    info = load_target_info(tmp_path)
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (61, 7168, 163840)
    assert info.aux_layer_ids() == [1, 29, 57]
    config = drafter_config(info, DrafterConfig(arch="mla"), 32000, info.aux_layer_ids())
    assert (config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim,
            config.qk_rope_head_dim, config.v_head_dim) == (64, 1536, 512, 128, 64, 128)
    shapes = expected_shapes(config)
    assert shapes["fc.weight"] == (7168, 3 * 7168) and shapes["lm_head.weight"] == (32000, 7168)
    assert shapes["midlayer.self_attn.q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 2 * 7168)
    assert shapes["midlayer.self_attn.kv_b_proj.weight"] == (64 * (128 + 128), 512)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (7168, 64 * 128)
    out = sglang_config(config)
    assert out["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and out["model_type"] == "deepseek_v3"
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert out["rope_scaling"]["factor"] == 64.0  # SGLang turns any scaling into deepseek_yarn for MLA
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(64.0)).item() + 1.0
    assert softmax_scale(config) == pytest.approx(192 ** -0.5 * mscale ** 2)
