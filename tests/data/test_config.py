import subprocess
import sys

import pytest

from data.config import ConfigError, load_config

YAML = """
run_dir: runs/x
target: {path: /models/t}
data:
  inputs: [a.jsonl]
  max_length: 512
"""


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(YAML)
    return p


def test_yaml_and_overrides(cfg_file):
    cfg = load_config(cfg_file, ["--data.max_length", "1024", "--target.aux_layer_ids=[2, 30, 58]",
                                 "--data.regenerate.enabled", "true", "--run_dir", "123"])
    assert cfg.data.max_length == 1024 and cfg.target.aux_layer_ids == [2, 30, 58]
    assert cfg.data.regenerate.enabled is True and cfg.run_dir == "123"
    assert cfg.data.overflow == "truncate"  # default kept


@pytest.mark.parametrize("args,message", [
    (["--data.max_lenght", "5"], "data.max_lenght: unknown key"),
    (["--data.max_length", "many"], "data.max_length: Input should be a valid integer"),
    (["--data.overflow", "wrap"], "data.overflow: Input should be 'truncate' or 'drop'"),
    (["--data.max_length", "4"], "data.max_length: Input should be greater than or equal to 8"),
    (["--bogus.key", "1"], "bogus: unknown key"),
    (["--target.aux_layer_ids", "[1, 2]"], "target.aux_layer_ids: Value error, EAGLE-3 drafters read exactly 3 layers"),
    (["--target.aux_layer_ids", "[1, 2, 3, 4]"], "got 4 ids"),
    (["--train.eval_fraction", "0.1"], "train.eval_fraction is now data.heldout_fraction"),  # a moved key says where
])
def test_errors_name_the_key(cfg_file, args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(cfg_file, args)


def test_a_wrong_key_is_blamed_on_where_it_came_from(cfg_file):
    with pytest.raises(ConfigError, match=r"data.max_length: .*\[command line --data.max_length\]"):
        load_config(cfg_file, ["--data.max_length", "many"])
    cfg_file.write_text(YAML.replace("max_length: 512", "max_length: many"))
    with pytest.raises(ConfigError, match=r"data.max_length: .*\[" + str(cfg_file) + r"\]"):
        load_config(cfg_file, ["--data.skip_malformed", "true"])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(YAML.replace("max_length: 512", "max_length: 512\n  shuffle: true"))
    with pytest.raises(ConfigError, match="data.shuffle: unknown key"):
        load_config(p)


def test_entry_point_prints_resolved_config_and_rejects_bad_keys(cfg_file):
    out = subprocess.run([sys.executable, "-m", "data", "--config", str(cfg_file), "--data.nope", "1"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "data.nope: unknown key" in out.stderr


def test_the_drafter_family_sets_how_many_aux_layers_and_which_options_fit(tmp_path):
    """EAGLE-3 reads exactly three layers; DFlash any number (its fc projects as many as its config names); an
    EAGLE-3 option with a DFlash drafter is refused naming the key."""
    import json

    from data.config import ConfigError, load_config
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"target": {"path": "t"}, "data": {"inputs": ["c.jsonl"]}}))
    dflash = load_config(path, ["--train.drafter.family", "dflash", "--target.aux_layer_ids", "[1, 2, 3, 4, 5]"])
    assert dflash.target.aux_layer_ids == [1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match=r"target.aux_layer_ids: Value error, EAGLE-3 drafters read exactly 3 .*"
                                          r"\[command line --target.aux_layer_ids\]"):
        load_config(path, ["--target.aux_layer_ids", "[1, 2, 3, 4, 5]"])
    with pytest.raises(ConfigError, match="train.drafter: Value error, fc_norm belong to EAGLE-3 drafters"):
        load_config(path, ["--train.drafter.family", "dflash", "--train.drafter.fc_norm", "true"])
    with pytest.raises(ConfigError, match="hidden_size is the target's for a DFlash drafter"):
        load_config(path, ["--train.drafter.family", "dflash", "--train.drafter.hidden_size", "256"])
