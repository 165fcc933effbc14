"""The transformers backend (extract/backend.py's protocol): any AutoModelForCausalLM target, aux states captured
with forward hooks.

Only the configured layers' outputs are kept (hooks, not `output_hidden_states`, which holds every layer),
and the decoder is called without the LM head, so no [T, vocab] logits are computed. The final hidden
state is the decoder's `last_hidden_state`: **after** the target's final norm ("post_norm"), which is
also what SGLang returns; the trainer's teacher then applies only the LM head.
"""
from __future__ import annotations

import torch

from data.target import AuxCapture, load_causal_lm

from .backend import BackendSpec


class HFBackend:
    max_forward_tokens = None  # extract.max_batch_tokens decides

    def __init__(self, spec: BackendSpec):
        model = load_causal_lm(spec.target_path, spec.dtype, spec.device, spec.trust_remote_code)
        self.decoder = model.get_decoder()
        del model  # drops the LM head; the decoder keeps its own modules
        self.device, self.aux_layer_ids = spec.device, spec.aux_layer_ids
        self.aux = AuxCapture(self.decoder.layers, spec.aux_layer_ids)

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] right-padded batch → aux [N, n_aux * H], final [N, H] on the device: each row's real tokens,
        row after row (N = attention_mask.sum()), the packed layout SGLang returns and the shards store."""
        mask = attention_mask.to(self.device)
        out = self.decoder(input_ids=input_ids.to(self.device), attention_mask=mask, use_cache=False)
        aux, final = self.aux.take(), out.last_hidden_state
        if bool(attention_mask.all()):  # no padding: packing is a view
            return aux.flatten(0, 1), final.flatten(0, 1)
        valid = mask.bool()
        return aux[valid], final[valid]
