"""Aux layer ids mean to SGLang what they mean to Eyrie: checked against SGLang's own set_eagle3_layers_to_capture."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from data.target import SGLANG_FIRST_ID_ONE_ARCHITECTURES, load_target_info, sglang_captured_outputs

ROOT = Path(__file__).resolve().parents[2]
CASES = [[1, 29, 57], [2, 30, 58], [0, 1, 2], [3, 5, 7]]
KIMI = "KimiK25ForConditionalGeneration"

# Runs in a process of its own: importing SGLang's model registry on a CPU stubs modules (serve/sglang_check.py).
# Each architecture's own capture hooks (EAGLE-3's and DFlash's, one import of the registry for both) run on a
# stand-in `self` that holds only what the method touches; SGLang then captures at the input of layer j, i.e.
# the output of layer j - 1.
HOOKS = ["set_eagle3_layers_to_capture", "set_dflash_layers_to_capture"]
PROBE = r"""
import json, sys
from types import SimpleNamespace as N
from serve.sglang_check import _stub_modules
_stub_modules()
from sglang.srt.models.registry import ModelRegistry
cases, hooks = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {hook: {} for hook in hooks}
for arch in sorted(ModelRegistry.get_supported_archs()):
    try:
        cls, _ = ModelRegistry.resolve_model_cls([arch])
    except Exception:
        continue
    for hook in hooks:
        if not hasattr(cls, hook):
            continue
        rows = []
        for ids in cases:
            inner = N()  # a multimodal wrapper hands the ids to its language model: recorded, not followed
            setattr(inner, hook, lambda i, s=inner: setattr(s, "delegated", i))
            me = N(pp_group=N(is_last_rank=True), config=N(num_hidden_layers=61), model=N(), language_model=inner)
            try:
                getattr(cls, hook)(me, ids)
            except Exception:
                break
            if hasattr(inner, "delegated"):
                rows = "delegates" if inner.delegated == ids else None
                break
            if not hasattr(me.model, "layers_to_capture"):
                break
            rows.append([j - 1 for j in me.model.layers_to_capture])
        if rows == "delegates" or rows and len(rows) == len(cases):
            out[hook][arch] = rows
print("PROBE " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def captured() -> dict[str, dict]:
    """{hook: {architecture: the layer outputs SGLang captures for each of CASES, or "delegates"}}."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    run = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES), json.dumps(HOOKS)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line, run.stderr[-3000:]
    return json.loads(line[len("PROBE "):])


def test_every_sglang_architecture_captures_what_sglang_captured_outputs_says(captured):
    table = captured["set_eagle3_layers_to_capture"]
    # the probe reached the architectures that matter here, and enough others to see the rule is the exception
    assert SGLANG_FIRST_ID_ONE_ARCHITECTURES - {KIMI} | {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(table)
    assert len(table) > 20
    # MTP / EAGLE draft models (DeepSeek's NextN layer ...) reuse DeepseekV3's method but are never a target
    wrong = {arch: rows for arch, rows in table.items() if rows != "delegates" and not arch.endswith(("NextN", "Eagle"))
             and rows != [sglang_captured_outputs(arch, ids) for ids in CASES]}
    assert wrong == {}
    # Kimi-K2.5 hands the ids to the DeepseekV3ForCausalLM it builds as its language model
    assert table[KIMI] == "delegates" and table["DeepseekV3ForCausalLM"][1] == [1, 29, 57]
    import sglang
    kimi = (Path(sglang.__file__).parent / "srt" / "models" / "kimi_k25.py").read_text()
    assert "self.language_model = DeepseekV3ForCausalLM(" in kimi


def write_target(path: Path, architecture: str, layers: int) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": [architecture], "text_config": {
        "num_hidden_layers": layers, "hidden_size": 7168, "vocab_size": 163840}}))
    return path


def test_kimi_ids_are_refused_where_sglang_would_serve_other_layers_and_imported_ids_are_translated(tmp_path):
    kimi = load_target_info(write_target(tmp_path / "kimi", KIMI, 61))
    assert kimi.aux_layer_ids() == [1, 29, 57]
    with pytest.raises(ValueError, match=r"outputs of layers \[1, 29, 57\]"):
        kimi.aux_layer_ids([2, 30, 58])
    with pytest.raises(ValueError, match=r"outputs of layers \[-1, 0, 1\] \(-1 = the embedding\)"):
        kimi.aux_layer_ids([0, 1, 2])
    with pytest.raises(ValueError, match=r"last layer's output \(id 60\)"):
        kimi.aux_layer_ids([1, 30, 60])
    assert kimi.drafter_layer_ids([2, 30, 58]) == [1, 29, 57] == kimi.drafter_layer_ids([1, 29, 57])
    with pytest.raises(ValueError, match="outside 0..60"):
        kimi.drafter_layer_ids([0, 1, 2])  # SGLang would feed it the embedding

    llama = load_target_info(write_target(tmp_path / "llama", "LlamaForCausalLM", 32))
    assert llama.aux_layer_ids([0, 1, 2]) == [0, 1, 2] == llama.drafter_layer_ids([0, 1, 2])
    assert llama.drafter_layer_ids([2, 30, 28]) == [2, 30, 28]
    with pytest.raises(ValueError, match=r"last layer's output \(id 31\)"):
        llama.aux_layer_ids([1, 15, 31])


def test_every_sglang_architecture_captures_dflash_ids_as_layer_outputs(captured):
    """DFlash's capture hook (set_dflash_layers_to_capture) adds 1 to every id on every architecture that has one,
    DeepseekV2's family included: a DFlash id is the output of that layer, with no first-id rule."""
    table = {arch: rows for arch, rows in captured["set_dflash_layers_to_capture"].items() if rows != "delegates"}
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"} <= set(table)
    assert {arch: rows for arch, rows in table.items() if rows != CASES} == {}


def test_dflash_ids_default_as_sglangs_and_skip_the_eagle_first_id_rule(tmp_path):
    kimi = load_target_info(write_target(tmp_path / "kimi", KIMI, 61))
    assert kimi.aux_layer_ids(None, "dflash", 5) == [1, 15, 30, 44, 58]  # dflash_utils.build_target_layer_ids
    assert kimi.aux_layer_ids(None, "dflash", 1) == [30]
    assert kimi.aux_layer_ids([2, 30, 58], "dflash") == [2, 30, 58]  # refused for EAGLE-3 above
    with pytest.raises(ValueError, match=r"last layer's output \(id 60\)"):
        kimi.aux_layer_ids([2, 60], "dflash")
