"""Export: DeepSpeed checkpoints of ZeRO-2 and ZeRO-3 → SGLang drafter dirs that SGLang's own loader accepts,
re-import equal to the trainer's weights, and broken drafters rejected by both checks."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from serve.drafter_dir import DrafterDirError, read_config, read_tensors, validate
from serve.export import consolidate, export, import_sglang

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None  # not imported: the check imports it in its worker
needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="not run: SGLang's loader check needs sglang "
                                  "(sh serve/install_sglang_cpu.sh installs its CPU-loadable part)")


@pytest.fixture(scope="module")
def exported(zero2_run, zero3_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    reports = {stage: export(run, "latest", out / f"zero{stage}", check_with_sglang=HAVE_SGLANG)
               for stage, (run, _) in ((2, zero2_run), (3, zero3_run))}
    return out, reports


@pytest.mark.parametrize("stage", [2, 3])
def test_export_round_trip(stage, exported, zero2_run, zero3_run):
    out, reports = exported
    run = (zero2_run if stage == 2 else zero3_run)[0]
    drafter = out / f"zero{stage}"
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False and config["draft_vocab_size"] == 128
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and "rope_scaling" in config
    tensors = load_file(str(drafter / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors  # same hidden size as the target: SGLang shares the target's
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    trained = consolidate(run / "train" / "checkpoints", "step12")
    for name, t in tensors.items():
        want = trained[name]
        assert torch.equal(t, want.to(torch.bfloat16) if want.is_floating_point() else want.to(t.dtype)), name
    again = import_sglang(drafter, out / f"reimported{stage}", check_with_sglang=False)
    assert again["tensors"] == len(tensors)
    back = read_tensors(out / f"reimported{stage}")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    card = (drafter / "README.md").read_text()
    summary = json.loads((run / "train" / "summary.json").read_text())
    tau3 = 1 + sum(summary["eval"][f"p_accepted_through_step{j}"] for j in range(3))
    # the figure quoted is the one for the chain of the serve command it prints (TTT trained 3 steps here)
    assert "for the serve command below\n  (3 steps / top-k 1 / 4 draft tokens)" in card and f"**{tau3:.3f}**" in card
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1\n--speculative-num-draft-tokens 4" in card
    assert "held-out overlap with\n  training: 0" in card
    if HAVE_SGLANG:
        assert reports[stage]["sglang_check"]["ok"], reports[stage]
    # ZeRO-2 and ZeRO-3 trained the same drafter (up to reduction order)
    other = load_file(str(out / f"zero{5 - stage}" / "model.safetensors"))
    assert all(torch.allclose(v.float(), other[k].float(), atol=2e-2) for k, v in tensors.items())


def _break(src, dst, how):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if how == "misnamed tensor":
        tensors["midlayer.mlp.upproj.weight"] = tensors.pop("midlayer.mlp.up_proj.weight")
    elif how == "wrong shape":
        tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    elif how == "missing d2t":
        del tensors["d2t"]
    elif how == "wrong draft_vocab_size":
        config["draft_vocab_size"] += 1
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


BROKEN = ["misnamed tensor", "wrong shape", "missing d2t", "wrong draft_vocab_size"]


@pytest.mark.parametrize("how", BROKEN)
def test_broken_drafters_fail_validation(how, exported, tmp_path):
    bad = _break(exported[0] / "zero2", tmp_path / "bad", how)
    with pytest.raises(DrafterDirError):
        validate(read_config(bad), read_tensors(bad), str(bad))
    with pytest.raises(DrafterDirError):
        import_sglang(bad, tmp_path / "imported", check_with_sglang=False)


@needs_sglang
def test_broken_drafters_fail_sglangs_own_loader(exported, tmp_path, monkeypatch):
    """Our validation aside, SGLang's loader check itself catches each (it would load most of them silently);
    one interpreter checks them all, the good one among them, named relative to the working directory (the check
    runs elsewhere: a relative --out once failed there with a Hugging Face repo-id error)."""
    from serve.sglang_check import check_in_subprocess
    bad = [_break(exported[0] / "zero2", tmp_path / how.replace(" ", "-"), how) for how in BROKEN]
    monkeypatch.chdir(exported[0])
    reports = check_in_subprocess("zero2", *bad, raise_on_problem=False)
    assert reports[0]["ok"] and reports[0]["directory"] == str(exported[0] / "zero2"), reports[0]
    problems = {how: " ".join(r["problems"]) for how, r in zip(BROKEN, reports[1:])}
    assert "up_proj" in problems["misnamed tensor"] and "not written" in problems["misnamed tensor"], problems
    assert "raised" in problems["wrong shape"] and "95" in problems["wrong shape"], problems
    assert problems["missing d2t"].startswith("no d2t"), problems
    assert "raised" in problems["wrong draft_vocab_size"] and "129" in problems["wrong draft_vocab_size"], problems


@needs_sglang
def test_one_checker_serves_a_process_and_a_dead_one_is_replaced(exported):
    """SGLang's imports are paid once per process: later checks go to the same worker interpreter; a worker that
    died (killed here, as a crash would leave it) is replaced at the next check, which still answers; one that
    runs past the check's time limit is stopped and named so."""
    from serve import sglang_check
    first = sglang_check.check_in_subprocess(exported[0] / "zero2")
    worker = sglang_check._WORKER.proc
    again = sglang_check.check_in_subprocess(exported[0] / "zero3")
    assert sglang_check._WORKER.proc is worker and worker.poll() is None
    assert first[0]["ok"] and again[0]["ok"] and again[0]["directory"].endswith("zero3"), (first, again)
    worker.kill()
    worker.wait()
    after = sglang_check.check_in_subprocess(exported[0] / "zero2")
    assert after[0]["ok"] and sglang_check._WORKER.proc is not worker
    with pytest.raises(RuntimeError, match="ran past 0.001 s"):  # a hung check: its worker is stopped
        sglang_check.check_in_subprocess(exported[0] / "zero2", timeout=0.001)
    assert sglang_check._WORKER.proc.poll() is not None


@needs_sglang
@pytest.mark.parametrize("declared", ["bfloat16", "float32", None])
def test_sglang_resolves_drafter_and_target_to_one_dtype(declared, tmp_path):
    """SGLang picks each model's dtype from its own config (`--dtype auto`; float32 or none declared → float16):
    a drafter declaring another dtype than its target gets mixed-dtype inputs and its CUDA graph capture fails
    ("expected mat1 and mat2 to have the same dtype"), as the first mission smoke test did."""
    from transformers import AutoConfig, LlamaConfig

    from data.config import DrafterConfig
    from data.target import load_target_info
    from serve.drafter_dir import sglang_config
    from serve.sglang_check import _stub_modules
    from train.drafter import drafter_config
    _stub_modules()
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    target, drafter = tmp_path / "target", tmp_path / "drafter"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=256,
                **({"dtype": declared} if declared else {})).save_pretrained(target)
    info = load_target_info(target)
    drafter.mkdir()
    config = drafter_config(info, DrafterConfig(), 128, [0, 1, 2])
    (drafter / "config.json").write_text(json.dumps(sglang_config(config)))
    served = {p.name: _get_and_verify_dtype(AutoConfig.from_pretrained(p), "auto") for p in (target, drafter)}
    assert served["target"] == served["drafter"] == (torch.bfloat16 if declared == "bfloat16" else torch.float16)
    from serve.smoke import sglang_auto_dtype  # the smoke test's pre-flight check reads SGLang's rule alike
    assert getattr(torch, sglang_auto_dtype(declared)) == served["target"]


def test_import_keeps_what_the_drafter_was_and_states_every_change(exported, zero2_run, tmp_path):
    """A published fp16 drafter that ships the embedding SGLang replaces and names no layer ids: its weights stay
    fp16 (not rounded to bf16), the embedding is dropped and said so, and with --target its ids are SGLang's
    default for that target; without --target the error says how to import it."""
    trained_on = json.loads((zero2_run[0] / "train" / "summary.json").read_text())["config"]["target"]["path"]
    target = tmp_path / "target-8-layers"  # its description is all the import reads: 8 layers give distinct ids
    target.mkdir()
    target_config = json.loads((Path(trained_on) / "config.json").read_text()) | {"num_hidden_layers": 8}
    (target / "config.json").write_text(json.dumps(target_config))
    src = tmp_path / "published"
    shutil.copytree(exported[0] / "zero2", src)
    tensors = {k: v.to(torch.float16) if v.is_floating_point() else v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    H = tensors["midlayer.input_layernorm.weight"].shape[0]
    config = json.loads((src / "config.json").read_text())
    tensors["embed_tokens.weight"] = torch.randn(config["vocab_size"], H).half()
    save_file(tensors, str(src / "model.safetensors"))
    del config["eagle_config"]
    config |= {"dtype": "float16", "torch_dtype": "float16"}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterDirError, match="import with --target TARGET"):
        import_sglang(src, tmp_path / "no-target", check_with_sglang=False)
    report = import_sglang(src, tmp_path / "imported", check_with_sglang=False, target=target)
    back = load_file(str(tmp_path / "imported" / "model.safetensors"))
    assert report["weights_dtype"] == ["float16"] and back["fc.weight"].dtype == torch.float16
    assert torch.equal(back["fc.weight"], tensors["fc.weight"])  # bit for bit, not through bf16
    assert "embed_tokens.weight" not in back and any("embed_tokens.weight dropped" in n for n in report["changes"])
    written = json.loads((tmp_path / "imported" / "config.json").read_text())
    # SGLang captures [2, L//2, L-3] for a drafter naming no ids: the outputs of layers [1, 3, 4] for L = 8
    assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    card = (tmp_path / "imported" / "README.md").read_text()
    assert "took" in card and "set_eagle3_layers_to_capture(None)" in card and "weights float16" in card
