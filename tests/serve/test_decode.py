"""The reference speculative decoder on the demo: lossless, a trained drafter accepted far more often than an
untrained one, and the offline evaluator agreeing with the decoder's measured accept length."""
import json

import torch

from serve.decode import Target, greedy, speculative
from serve.drafter_dir import load_drafter, read_config, read_tensors
from serve.evaluate import held_out_prompts
from serve.export import write_drafter_dir


def test_demo_report_has_the_measured_acceptance(demo_run):
    run, _, out = demo_run
    report = json.loads((run / "report.json").read_text())
    drafter = report["drafter"]
    assert (run / "drafter" / "config.json").exists() and "[pipeline] evaluate:" in out
    assert drafter["reference_decoder"]["identical_to_greedy"] is True
    offline = drafter["offline_accept_length_by_steps"][2]  # 3 steps, as the decoder ran
    decoded = drafter["reference_decoder"]["accept_length"]
    assert decoded > 2.0, drafter
    # the tolerance we state: offline (teacher-forced, held-out samples) within 10% of the decoder (held-out
    # prompts); the demo data are the target's own greedy answers, which is what makes the two comparable
    assert abs(offline - decoded) / decoded < 0.10, (offline, decoded)


def test_lossless_and_trained_beats_untrained(demo_run, tmp_path):
    run, _, _ = demo_run
    config, tensors = read_config(run / "drafter"), read_tensors(run / "drafter")
    torch.manual_seed(0)
    untrained = {k: (torch.randn_like(v.float()) * 0.05).to(v.dtype) if v.is_floating_point() else v
                 for k, v in tensors.items()}
    write_drafter_dir(tmp_path / "untrained", config, untrained, "untrained\n")
    summary = json.loads((run / "train" / "summary.json").read_text())
    target_path = summary["config"]["target"]["path"]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_path)
    target = Target(target_path, config.eagle_config["eagle_aux_hidden_state_layer_ids"], torch.device("cpu"),
                    torch.float32)
    lengths = {}
    for name, directory in (("trained", run / "drafter"), ("untrained", tmp_path / "untrained")):
        drafter = load_drafter(directory, target_path, torch.device("cpu"))
        generated = calls = 0
        for messages in held_out_prompts(run, 6):
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            base = greedy(target, prompt, 48, {tok.eos_token_id})
            spec = speculative(target, drafter, prompt, 48, {tok.eos_token_id}, steps=4)
            assert spec.tokens == base.tokens, (name, messages)
            generated, calls = generated + len(spec.tokens), calls + spec.verify_calls
        lengths[name] = generated / calls
    assert lengths["untrained"] < 1.3 and lengths["trained"] > lengths["untrained"] + 1.0, lengths
