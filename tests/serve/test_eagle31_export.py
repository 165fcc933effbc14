"""EAGLE-3.1 options (fc_norm, norm_output) through export, SGLang's own loader for both drafter classes, and
import; norm_before_fc, which SGLang 0.5.14 reads for neither class, refused at config time and on import."""
import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from data.config import DrafterConfig
from data.target import load_target_info
from serve.drafter_dir import DrafterDirError, load_drafter, read_config, read_tensors, validate
from serve.export import write_drafter_dir
from tests.serve.test_export import needs_sglang
from train.drafter import Eagle3Drafter, drafter_config

OPTIONS = {"fc_norm": True, "norm_output": True}


def drafter_for(target, arch: str = "llama", **options) -> Eagle3Drafter:
    ids = [0, 1, 2] if arch == "llama" else [1, 2, 3]  # a 4-layer Llama; SGLang's DeepseekV2 reading of ids from 1
    config = drafter_config(load_target_info(target), DrafterConfig(arch=arch, **options), 16, ids)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[:16] = True
    torch.manual_seed(0)
    model = Eagle3Drafter(config, torch.zeros(16, dtype=torch.int64), t2d)
    for norm in model.fc_norm or []:  # weights away from 1, so that a norm left unloaded shows
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    return model


def export(drafter: Eagle3Drafter, out) -> None:
    write_drafter_dir(out, drafter.config, {k: v for k, v in drafter.state_dict().items()
                                            if k != "embed_tokens.weight"}, "test")


def test_norm_before_fc_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match="read no norm_before_fc key"):
        DrafterConfig(norm_before_fc=True)


def test_options_are_exported_as_sglangs_keys_and_read_back(tiny_target, tmp_path):
    drafter = drafter_for(tiny_target, **OPTIONS)
    export(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True and "norm_before_fc" not in config
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(str(tmp_path / "d" / "model.safetensors")))
    back = load_drafter(tmp_path / "d", tiny_target, torch.device("cpu"))
    assert back.norm_output and all(torch.allclose(a.weight, b.weight.bfloat16().float())
                                    for a, b in zip(back.fc_norm, drafter.fc_norm))
    plain = json.loads(json.dumps(config))
    del plain["fc_norm"]  # the same tensors under a config without the option: SGLang would skip the norms
    (tmp_path / "d" / "config.json").write_text(json.dumps(plain))
    with pytest.raises(DrafterDirError, match="unexpected tensor fc_norm.0.weight"):
        validate(read_config(tmp_path / "d"), read_tensors(tmp_path / "d"), "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps(config | {"norm_before_fc": True}))
    with pytest.raises(DrafterDirError, match="norm_before_fc is set"):
        read_config(tmp_path / "d")


def test_a_published_drafter_with_the_legacy_names_imports_as_fc_norm(tiny_target, tmp_path):
    """`use_aux_norm` and aux_norm_low/mid/high: the names SGLang's Llama loader still maps to fc_norm."""
    drafter = drafter_for(tiny_target, **OPTIONS)
    export(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["use_aux_norm"] = config.pop("fc_norm")
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    for i, legacy in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
        tensors[f"{legacy}.weight"] = tensors.pop(f"fc_norm.{i}.weight")
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    back = load_drafter(tmp_path / "d", tiny_target, torch.device("cpu"))
    assert all(torch.allclose(a.weight, b.weight.bfloat16().float()) for a, b in zip(back.fc_norm, drafter.fc_norm))


@needs_sglang
def test_sglangs_loader_builds_both_classes_with_the_options(tmp_path):
    """Each class, options on and off, through SGLang's own loader on the CPU: every fc_norm weight lands and
    SGLang's model has the options the config states (DeepSeek YaRN RoPE: what SGLang builds for MLA on a CPU)."""
    from launch.demo_target import SGLANG_MLA_DIMS, build_tiny_deepseek, build_tiny_llama
    from serve.sglang_check import check_in_subprocess
    from tests.train.test_mla import YARN
    build_tiny_llama(tmp_path / "llama", vocab_size=64, hidden=64, heads=4)
    build_tiny_deepseek(tmp_path / "deepseek", vocab_size=64, rope_parameters=YARN, **SGLANG_MLA_DIMS)
    cases = {"llama-3.1": ("llama", "llama", OPTIONS), "llama-3": ("llama", "llama", {}),
             "mla-3.1": ("deepseek", "mla", OPTIONS), "mla-3": ("deepseek", "mla", {})}
    for name, (target, arch, options) in cases.items():
        export(drafter_for(tmp_path / target, arch, **options), tmp_path / name)
    reports = dict(zip(cases, check_in_subprocess(*(tmp_path / name for name in cases), raise_on_problem=False)))
    for name, (_, arch, options) in cases.items():
        r = reports[name]
        assert r["ok"], r
        assert r["architecture"] == ("LlamaForCausalLMEagle3" if arch == "llama" else "Eagle3DeepseekV2ForCausalLM")
        assert r["eagle31_options"] == {"fc_norm": bool(options), "norm_output": bool(options)}, r
    assert reports["llama-3.1"]["parameters"] == reports["llama-3"]["parameters"] + 3  # the three fc_norm weights


def test_a_drafter_trained_with_the_options_exports_them(features_run, tmp_path):
    """Two gloo ranks of DeepSpeed ZeRO-2 (train/main.py, as the pipeline launches it) with both options: the
    fc_norm weights are trained away from their initial 1, the loss falls, and the export states the options
    and passes SGLang's loader (when installed)."""
    from serve.export import export as export_run
    from tests.serve.test_export import HAVE_SGLANG
    from tests.train_runs import finish, launch, losses, with_run_dir
    run = tmp_path / "run"
    finish(launch(with_run_dir(features_run, run), "--train.drafter.fc_norm", "true",
                  "--train.drafter.norm_output", "true"))
    loss = losses(run)
    assert loss[max(loss)] < 0.95 * loss[min(loss)], loss  # 12.15 → 11.30 over these 12 steps
    report = export_run(run, "latest", tmp_path / "drafter", check_with_sglang=HAVE_SGLANG)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    tensors = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    assert all((tensors[f"fc_norm.{i}.weight"].float() - 1).abs().max() > 1e-3 for i in range(3))
    if HAVE_SGLANG:
        assert report["sglang_check"]["ok"] and report["sglang_check"]["eagle31_options"] == OPTIONS, report
