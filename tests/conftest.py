import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from launch.demo_target import build_tokenizer, make_conversations  # noqa: E402
from tests.templates import SPECIALS  # noqa: E402


def _corpus() -> list[str]:
    texts = [m["content"] for c in make_conversations(300, seed=7) for m in c["messages"]]
    return texts + ["think about it", "get_weather city Paris", "The weather in Paris is sunny."]


@pytest.fixture(scope="session")
def make_tokenizer(tmp_path_factory):
    """Tokenizer per template style ('llama3', 'chatml', 'kimi'), trained with `tokenizers` once a session."""
    cache = {}

    def make(style: str):
        if style not in cache:
            template, specials, bos, eos = SPECIALS[style]
            out = tmp_path_factory.mktemp(f"tok-{style}")
            cache[style] = build_tokenizer(_corpus(), out, vocab_size=400, chat_template=template,
                                           special_tokens=specials, bos=bos, eos=eos)
        return cache[style]
    return make


@pytest.fixture(scope="session")
def tiny_target(make_tokenizer, tmp_path_factory):
    """A random tiny Llama target directory with the llama3-style tokenizer (config, safetensors, tokenizer)."""
    from launch.demo_target import build_tiny_llama
    tok = make_tokenizer("llama3")
    out = tmp_path_factory.mktemp("target")
    tok.save_pretrained(str(out))
    build_tiny_llama(out, vocab_size=len(tok), hidden=32, layers=4, heads=4, seed=0,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return out
